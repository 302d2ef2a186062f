/* Two processes through the C ABI: the parent exports a contiguous and a transposed
 * float32 view with release callbacks; a forked child imports, verifies every element,
 * writes through its mapping (zero-copy), and releases; each callback must run exactly
 * once. Then a second child holding 100 leases is SIGKILLed: every callback must run,
 * once. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>

#include "common.h"

#define ROWS 32
#define COLS 64
#define HOLD 100

static atomic_int released[2 + HOLD];


static int child_verify(int fd) {
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, NULL, &peer));
  EXPECT(tw_peer_pid(peer) == (int32_t)getppid());
  tw_imported_t *a = expect_tensor(peer);
  tw_imported_t *b = expect_tensor(peer);
  tw_layout_t la, lb;
  CHECK(tw_imported_layout(a, &la));
  CHECK(tw_imported_layout(b, &lb));
  EXPECT(la.dtype == TW_DTYPE_FLOAT32 && la.ndim == 2 && la.sizes[0] == ROWS && la.sizes[1] == COLS);
  EXPECT(lb.ndim == 2 && lb.sizes[0] == COLS && lb.sizes[1] == ROWS && lb.strides[0] == 1 && lb.strides[1] == COLS);
  const float *pa = tw_imported_data(a), *pb = tw_imported_data(b);
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) EXPECT(pa[i * COLS + j] == matrix_value(i, j));
  for (int j = 0; j < COLS; j++)
    for (int i = 0; i < ROWS; i++) EXPECT(pb[j * lb.strides[0] + i * lb.strides[1]] == matrix_value(i, j));
  EXPECT(tw_imported_tag(a) == 11 && tw_imported_tag(b) == 12);
  ((float *)tw_imported_data(a))[0] = -1.0f; /* the parent must see this: zero-copy */
  send_text(peer, "verified");
  CHECK(tw_imported_release(a));
  CHECK(tw_imported_release(b));
  expect_peer_gone(peer);
  tw_peer_free(peer);
  return 0;
}

static int child_hold(int fd) {
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, NULL, &peer));
  static tw_imported_t *held[HOLD];
  for (int i = 0; i < HOLD; i++) held[i] = expect_tensor(peer);
  EXPECT(tw_imported_tag(held[HOLD - 1]) == HOLD - 1);
  send_text(peer, "holding");
  for (;;) pause(); /* until SIGKILL */
}

int main(void) {
  /* Phase 1: share, verify in the child, zero-copy, release. */
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(child_verify, NULL, &peer);
  tw_layout_t contiguous;
  tw_segment_t *seg = matrix_segment(ROWS, COLS, &contiguous);
  float *data = tw_segment_data(seg);
  tw_layout_t transposed_view = transposed(contiguous);
  size_t nbytes = tw_segment_len(seg);
  tw_lease_t lease;
  CHECK(tw_peer_export(peer, seg, 0, nbytes, &contiguous, 11, 0, on_release, &released[0], &lease));
  CHECK(tw_peer_export(peer, seg, 0, nbytes, &transposed_view, 12, 0, on_release, &released[1], NULL));
  expect_message(peer, "verified");
  EXPECT(data[0] == -1.0f);
  wait_released(peer, 10000);
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1);
  tw_lease_stats_t s;
  CHECK(tw_peer_stats(peer, &s));
  EXPECT(s.granted == 2 && s.released == 2 && s.live_bytes == 0);
  tw_peer_free(peer);
  expect_child_ok(pid);
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1);

  /* Phase 2: a child holding 100 leases is SIGKILLed. */
  pid = spawn_peer(child_hold, NULL, &peer);
  for (int i = 0; i < HOLD; i++)
    CHECK(tw_peer_export(peer, seg, 0, nbytes, &contiguous, (uint64_t)i, 0, on_release, &released[2 + i], NULL));
  expect_message(peer, "holding");
  for (int i = 0; i < HOLD; i++) EXPECT(atomic_load(&released[2 + i]) == 0);
  EXPECT(kill(pid, SIGKILL) == 0);
  int status;
  EXPECT(waitpid(pid, &status, 0) == pid);
  wait_released(peer, 10000);
  CHECK(tw_peer_stats(peer, &s));
  EXPECT(s.reclaimed == HOLD);
  expect_peer_gone(peer);
  tw_peer_free(peer);
  for (int i = 0; i < HOLD; i++) EXPECT(atomic_load(&released[2 + i]) == 1);
  tw_segment_free(seg);
  printf("two_process: ok (2 verified imports, %d leases reclaimed after SIGKILL)\n", HOLD);
  return 0;
}
