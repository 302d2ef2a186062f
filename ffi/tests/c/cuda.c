/* The C ABI's CUDA entry points across two processes, as a C program would use them:
 * device memory comes from the driver API (libcuda.so.1 opened with dlopen; no CUDA
 * headers or toolkit needed), the parent exports a contiguous view and a transposed view
 * at an offset into the allocation (tw_peer_export_cuda, each write still queued on the
 * parent's stream), a forked child imports both, waits on its own stream
 * (tw_imported_cuda_wait), reads every byte back (DtoH) and checks it, and — once the
 * parent saw both owners still alive — releases one lease now (tw_imported_release) and
 * one after its stream (tw_imported_release_after). Each release callback must run
 * exactly once — also for an export the library refuses.
 *
 * Without a driver (dlopen fails) it checks that tw_peer_export_cuda is
 * TW_ERR_CUDA_UNAVAILABLE (and still calls the release callback once), prints a SKIPPED
 * line and exits 77 (ctest's SKIP_RETURN_CODE) — unless simcuda/run.sh started it
 * (TW_EXPECT_SIMCUDA), where that is a failure (load_driver). Runs plain and under valgrind on simcuda
 * (scripts/test.sh: simcuda/run.sh ctest -R c_cuda).
 *
 * The child forks before anyone in the parent calls into the driver: CUDA state does not
 * survive fork, so each process initialises the driver itself. */
#define _GNU_SOURCE
#include "common.h"
#include "cuda_driver.h"

#define ROWS 48
#define COLS 80
#define OFFSET 4096 /* the transposed view starts this far into the allocation */
#define NBYTES (ROWS * COLS * 4)
#define ALLOC (OFFSET + NBYTES)

/* Byte `p` of the allocation. */
static uint8_t pattern(size_t p) { return (uint8_t)((p * 31 + 7) % 251); }

static atomic_int released[3];

/* Read an import's storage on `s` (after waiting for the producer there) and compare
 * with the pattern the parent wrote, the storage starting `at` bytes into the
 * allocation; returns the first bad byte or -1. */
static long check_import(tw_imported_t *t, CUstream s, size_t at) {
  EXPECT(tw_imported_device(t) == 0);
  EXPECT(tw_imported_storage_len(t) == NBYTES);
  CHECK(tw_imported_cuda_wait(t, (size_t)s));
  uint8_t *host = copy_to_host((CUdeviceptr)(uintptr_t)tw_imported_storage(t), NBYTES, s);
  long bad = -1;
  for (size_t i = 0; i < NBYTES && bad < 0; i++)
    if (host[i] != pattern(at + i)) bad = (long)i;
  free(host);
  return bad;
}

static int child(int fd) {
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, NULL, &peer));
  CUstream s = start_driver();
  tw_imported_t *a = expect_tensor(peer);
  tw_imported_t *b = expect_tensor(peer);
  tw_layout_t la, lb;
  CHECK(tw_imported_layout(a, &la));
  CHECK(tw_imported_layout(b, &lb));
  EXPECT(tw_imported_tag(a) == 21 && tw_imported_tag(b) == 22);
  EXPECT(la.dtype == TW_DTYPE_FLOAT32 && la.ndim == 2 && la.sizes[0] == ROWS && la.sizes[1] == COLS);
  EXPECT(lb.ndim == 2 && lb.sizes[0] == COLS && lb.sizes[1] == ROWS && lb.strides[0] == 1 && lb.strides[1] == COLS);
  /* Element 0 of each view is its storage's first byte (storage_offset 0). */
  EXPECT(tw_imported_data(a) == tw_imported_storage(a) && tw_imported_data(b) == tw_imported_storage(b));
  long bad_a = check_import(a, s, 0), bad_b = check_import(b, s, OFFSET);
  char msg[64];
  int len = snprintf(msg, sizeof msg, "checked %ld %ld", bad_a, bad_b);
  CHECK(tw_peer_send_message(peer, (const uint8_t *)msg, (size_t)len, NULL, 0));
  /* The parent checks that both leases are still out, then says "release". */
  expect_message(peer, "release");
  CHECK(tw_imported_release(a));
  CHECK(tw_imported_release_after(b, (size_t)s));
  expect_peer_gone(peer);
  tw_peer_free(peer);
  CU(cu.StreamSynchronize(s));
  stop_driver(s);
  return 0;
}

/* Until the parent hangs up. */
static int child_without_driver(int fd) {
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, NULL, &peer));
  expect_peer_gone(peer);
  tw_peer_free(peer);
  return 0;
}

/* No driver: the export is refused by name, and its callback still runs once. */
static int no_driver(void) {
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(child_without_driver, NULL, &peer);
  EXPECT(!tw_cuda_available());
  int32_t n = -1;
  EXPECT_ERR(tw_cuda_device_count(&n), TW_ERR_CUDA_UNAVAILABLE, "");
  int64_t sizes[1] = {16};
  tw_layout_t l;
  CHECK(tw_layout_contiguous(TW_DTYPE_UINT8, sizes, 1, &l));
  EXPECT_ERR(tw_peer_export_cuda(peer, 0x10000, 16, &l, 0, 1, 0, on_release, &released[0], NULL), TW_ERR_CUDA_UNAVAILABLE,
             "CUDA unavailable");
  EXPECT(atomic_load(&released[0]) == 1);
  tw_peer_free(peer);
  expect_child_ok(pid);
  printf("SKIPPED c_cuda: no CUDA driver (libcuda.so.1 not loadable; run under simcuda/run.sh or on a GPU); "
         "checked: exports are TW_ERR_CUDA_UNAVAILABLE and release their owner once\n");
  return 77;
}

int main(void) {
  if (!load_driver()) return no_driver();
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(child, NULL, &peer); /* before any driver call in this process */
  CUstream s = start_driver();
  EXPECT(tw_cuda_available());

  CUdeviceptr buf;
  CU(cu.MemAlloc(&buf, ALLOC));
  uint8_t *host = malloc(ALLOC);
  EXPECT(host != NULL);
  for (size_t p = 0; p < ALLOC; p++) host[p] = pattern(p);
  /* Two queued copies, not synchronized: the exports must order the child after them. */
  CU(cu.MemcpyHtoDAsync(buf, host, OFFSET, s));
  CU(cu.MemcpyHtoDAsync(buf + OFFSET, host + OFFSET, NBYTES, s));
  free(host);

  int64_t sizes[2] = {ROWS, COLS};
  tw_layout_t contiguous;
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &contiguous));
  tw_layout_t transposed_view = transposed(contiguous);
  /* Past the end of the allocation: refused by name, callback still once. */
  EXPECT_ERR(tw_peer_export_cuda(peer, buf + OFFSET, ALLOC, &contiguous, (size_t)s, 20, 0, on_release, &released[2], NULL),
             TW_ERR_INVALID_ARGUMENT, "pass the end");
  EXPECT(atomic_load(&released[2]) == 1);
  CHECK(tw_peer_export_cuda(peer, buf, NBYTES, &contiguous, (size_t)s, 21, 0, on_release, &released[0], NULL));
  CHECK(tw_peer_export_cuda(peer, buf + OFFSET, NBYTES, &transposed_view, (size_t)s, 22, 0, on_release, &released[1],
                            NULL));

  /* The first bad byte of each view the child read: none. */
  expect_message(peer, "checked -1 -1");
  /* Both imports are still held: their owners must be alive. */
  sleep_ms(50);
  EXPECT(atomic_load(&released[0]) == 0 && atomic_load(&released[1]) == 0);
  send_text(peer, "release");
  wait_released(peer, TW_TEST_TIMEOUT_MS);
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1 && atomic_load(&released[2]) == 1);
  tw_lease_stats_t st;
  CHECK(tw_peer_stats(peer, &st));
  EXPECT(st.granted == 2 && st.released == 2 && st.live_bytes == 0);
  tw_peer_free(peer);
  expect_child_ok(pid);
  /* Freeing the peer ends nothing twice. */
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1 && atomic_load(&released[2]) == 1);
  CU(cu.MemFree(buf));
  stop_driver(s);
  printf("cuda: ok (2 CUDA views checked in a forked child, 3 release callbacks once each)\n");
  return 0;
}
