/* Forwarding a CUDA import through the C ABI, three processes: the parent writes a
 * float32 matrix into device memory (the copy still queued on its stream, behind a busy
 * stretch of memsets) and exports it
 * to a relay (forked), which forwards the view without the first row to a last process
 * (forked) with tw_peer_export_imported_cuda on its own stream — opening nothing through
 * the driver (its handle cache's open count does not move) — and lets go of its own
 * handle at once (tw_imported_release_after). The last waits on its stream, checks every
 * element, copies a mark into element 0 of its view device to device, holds the import
 * while the parent checks that its lease is still out, then releases after its stream.
 * The parent must see the mark once its lease is back (one memory, no copy), and each
 * release callback must run exactly once: the parent's after the last released, the
 * relay's for its forward, and for the forwards the relay's checks refuse (a CUDA import
 * given to tw_peer_export_imported, a view past the storage) before the call returns.
 *
 * Every process forks before it first calls into the driver (CUDA state does not survive
 * fork). Without a driver it prints SKIPPED and exits 77 (ctest's SKIP_RETURN_CODE) —
 * unless simcuda/run.sh started it (TW_EXPECT_SIMCUDA), where that is a failure
 * (load_driver). Runs
 * plain and under valgrind on simcuda (scripts/test.sh: simcuda/run.sh ctest -R c_cuda). */
#define _GNU_SOURCE
#include "common.h"
#include "cuda_driver.h"

#define ROWS 24
#define COLS 40
#define NBYTES (ROWS * COLS * 4)
#define MARK (-7.0f)

static atomic_int released;
static atomic_int relay_callbacks; /* in the relay process */

static int last(int up_fd) {
  tw_peer_t *up = NULL;
  CHECK(tw_peer_from_fd(up_fd, NULL, &up));
  CUstream s = start_driver();
  CUdeviceptr mark;
  CU(cu.MemAlloc(&mark, sizeof(float)));
  float m = MARK;
  CU(cu.MemcpyHtoDAsync(mark, &m, sizeof m, s));
  tw_imported_t *t = expect_tensor(up);
  tw_layout_t l;
  CHECK(tw_imported_layout(t, &l));
  EXPECT(tw_imported_device(t) == 0 && tw_imported_tag(t) == 9 && tw_imported_storage_len(t) == NBYTES);
  EXPECT(l.ndim == 2 && l.sizes[0] == ROWS - 1 && l.sizes[1] == COLS && l.storage_offset == COLS);
  CHECK(tw_imported_cuda_wait(t, (size_t)s));
  float *host = copy_to_host((CUdeviceptr)(uintptr_t)tw_imported_storage(t), NBYTES, s);
  long bad = -1;
  for (int i = 0; i < ROWS && bad < 0; i++)
    for (int j = 0; j < COLS && bad < 0; j++)
      if (host[i * COLS + j] != matrix_value(i, j)) bad = i * COLS + j;
  free(host);
  if (bad >= 0) {
    fprintf(stderr, "the last read other bytes than the parent wrote (element %ld)\n", bad);
    exit(1);
  }
  /* A device-to-device copy into the view's element 0, queued on our stream. */
  CU(cu.MemcpyDtoDAsync((CUdeviceptr)(uintptr_t)tw_imported_data(t), mark, sizeof(float), s));
  send_text(up, "written");
  expect_message(up, "release");
  CHECK(tw_imported_release_after(t, (size_t)s));
  send_text(up, "released");
  expect_peer_gone(up);
  tw_peer_free(up);
  CU(cu.StreamSynchronize(s));
  CU(cu.MemFree(mark));
  stop_driver(s);
  return 0;
}

static int relay(int host_fd) {
  tw_peer_t *host = NULL, *down = NULL;
  pid_t pid = spawn_peer(last, NULL, &down); /* before any driver call in this process */
  CHECK(tw_peer_from_fd(host_fd, NULL, &host));
  CUstream s = start_driver();
  tw_imported_t *imp = expect_tensor(host);
  /* Refused, each callback run before the call returned: the stream-less forward of a
   * CUDA import, and a view one row past the storage. */
  EXPECT_ERR(tw_peer_export_imported(down, imp, NULL, 1, 0, on_release, &relay_callbacks, NULL),
             TW_ERR_INVALID_ARGUMENT, "tw_peer_export_imported_cuda");
  EXPECT(atomic_load(&relay_callbacks) == 1);
  int64_t big_sizes[2] = {ROWS + 1, COLS};
  tw_layout_t big, view;
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, big_sizes, 2, &big));
  EXPECT_ERR(tw_peer_export_imported_cuda(down, imp, &big, (size_t)s, 1, 0, on_release, &relay_callbacks, NULL),
             TW_ERR_INVALID_ARGUMENT, "view needs");
  EXPECT(atomic_load(&relay_callbacks) == 2);
  /* The view without the first row. */
  int64_t sizes[2] = {ROWS - 1, COLS};
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &view));
  view.storage_offset = COLS;
  uint64_t opens_before = 0, opens_after = 0;
  tw_cuda_ipc_cache_stats(&opens_before, NULL);
  CHECK(tw_peer_export_imported_cuda(down, imp, &view, (size_t)s, 9, 0, on_release, &relay_callbacks, NULL));
  tw_cuda_ipc_cache_stats(&opens_after, NULL);
  EXPECT(opens_before == 1 && opens_after == 1); /* the import's open; the forward opened nothing */
  /* The forward's lease holds the import now: our handle lets go after our stream. */
  CHECK(tw_imported_release_after(imp, (size_t)s));
  expect_message(down, "written");
  send_text(host, "holding");
  expect_message(host, "go");
  send_text(down, "release");
  expect_message(down, "released");
  tw_lease_stats_t st = wait_released(down, TW_TEST_TIMEOUT_MS);
  EXPECT(st.live_leases == 0 && st.released == 1 && st.granted == 1 && atomic_load(&relay_callbacks) == 3);
  send_text(host, "forwarded");
  expect_message(host, "bye");
  tw_peer_free(down);
  expect_child_ok(pid);
  tw_peer_free(host);
  CU(cu.StreamSynchronize(s));
  stop_driver(s);
  return 0;
}

int main(void) {
  if (!load_driver()) {
    printf("SKIPPED c_cuda_forward: no CUDA driver (libcuda.so.1 not loadable; run under simcuda/run.sh or on a GPU)\n");
    return 77;
  }
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(relay, NULL, &peer); /* before any driver call in this process */
  CUstream s = start_driver();
  CUdeviceptr buf;
  CU(cu.MemAlloc(&buf, NBYTES));
  float *host = malloc(NBYTES);
  EXPECT(host != NULL);
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) host[i * COLS + j] = matrix_value(i, j);
  /* Queued behind a busy stretch of the stream, not synchronized: the export (and the
   * forward) must order the last after it, or it reads zeros. */
  for (int i = 0; i < 16; i++) CU(cu.MemsetD8Async(buf, 0, NBYTES, s));
  CU(cu.MemcpyHtoDAsync(buf, host, NBYTES, s));
  int64_t sizes[2] = {ROWS, COLS};
  tw_layout_t l;
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &l));
  CHECK(tw_peer_export_cuda(peer, buf, NBYTES, &l, (size_t)s, 4, 0, on_release, &released, NULL));
  expect_message(peer, "holding");
  expect_forward_held_then_released(peer, &released);
  /* The last's write, in our memory once the lease is back. */
  free(host);
  host = copy_to_host(buf, NBYTES, s);
  if (host[COLS] != MARK || host[COLS + 1] != matrix_value(1, 1) || host[0] != matrix_value(0, 0)) {
    fprintf(stderr, "the last's write is not in the parent's memory: %g %g %g\n", host[0], host[COLS], host[COLS + 1]);
    exit(1);
  }
  free(host);
  send_text(peer, "bye");
  expect_child_ok(pid);
  tw_peer_free(peer);
  EXPECT(atomic_load(&released) == 1);
  CU(cu.MemFree(buf));
  stop_driver(s);
  printf("cuda_forward: ok (host -> relay -> last, one device memory, nothing reopened, released once)\n");
  return 0;
}
