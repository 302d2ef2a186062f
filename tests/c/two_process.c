/* Two processes through the C ABI: the parent exports a contiguous and a transposed
 * float32 view with release callbacks; a forked child imports, verifies every element,
 * writes through its mapping (zero-copy), and releases; each callback must run exactly
 * once. Then a second child holding 100 leases is SIGKILLed: every callback must run,
 * once. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define ROWS 32
#define COLS 64
#define HOLD 100

static atomic_int released[2 + HOLD];

static void on_release(void *ctx) { atomic_fetch_add((atomic_int *)ctx, 1); }

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void expect_message(tw_peer_t *peer, const char *want) {
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  CHECK(tw_peer_recv(peer, 20000, &t, &m));
  EXPECT(t == NULL && m != NULL);
  size_t len = 0;
  const uint8_t *data = tw_message_data(m, &len);
  EXPECT(len == strlen(want) && memcmp(data, want, len) == 0);
  tw_message_free(m);
}

static tw_imported_t *expect_tensor(tw_peer_t *peer) {
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  CHECK(tw_peer_recv(peer, 20000, &t, &m));
  EXPECT(t != NULL && m == NULL);
  return t;
}

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
    for (int j = 0; j < COLS; j++) EXPECT(pa[i * COLS + j] == (float)(i * 1000 + j));
  for (int j = 0; j < COLS; j++)
    for (int i = 0; i < ROWS; i++) EXPECT(pb[j * lb.strides[0] + i * lb.strides[1]] == (float)(i * 1000 + j));
  EXPECT(tw_imported_tag(a) == 11 && tw_imported_tag(b) == 12);
  ((float *)tw_imported_data(a))[0] = -1.0f; /* the parent must see this: zero-copy */
  CHECK(tw_peer_send_message(peer, (const uint8_t *)"verified", 8, NULL, 0));
  CHECK(tw_imported_release(a));
  CHECK(tw_imported_release(b));
  /* Wait for the parent to hang up. */
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  EXPECT(tw_peer_recv(peer, 20000, &t, &m) == TW_ERR_PEER_GONE);
  tw_peer_free(peer);
  return 0;
}

static int child_hold(int fd) {
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, NULL, &peer));
  static tw_imported_t *held[HOLD];
  for (int i = 0; i < HOLD; i++) held[i] = expect_tensor(peer);
  EXPECT(tw_imported_tag(held[HOLD - 1]) == HOLD - 1);
  CHECK(tw_peer_send_message(peer, (const uint8_t *)"holding", 7, NULL, 0));
  for (;;) pause(); /* until SIGKILL */
}

static pid_t spawn(int (*fn)(int), tw_peer_t **peer) {
  int a, b;
  CHECK(tw_socketpair(&a, &b));
  pid_t pid = fork();
  EXPECT(pid >= 0);
  if (pid == 0) {
    close(a);
    _exit(fn(b));
  }
  close(b);
  CHECK(tw_peer_from_fd(a, NULL, peer));
  EXPECT(tw_peer_pid(*peer) == pid);
  return pid;
}

static void wait_released(tw_peer_t *peer) {
  tw_lease_stats_t s;
  for (int i = 0; i < 2000; i++) {
    CHECK(tw_peer_reap(peer, &s));
    if (s.live_leases == 0) return;
    sleep_ms(5);
  }
  fprintf(stderr, "leases still live after 10 s: %llu\n", (unsigned long long)s.live_leases);
  exit(1);
}

int main(void) {
  /* Phase 1: share, verify in the child, zero-copy, release. */
  tw_peer_t *peer = NULL;
  pid_t pid = spawn(child_verify, &peer);
  tw_segment_t *seg = NULL;
  CHECK(tw_segment_new(ROWS * COLS * sizeof(float), &seg));
  float *data = tw_segment_data(seg);
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) data[i * COLS + j] = (float)(i * 1000 + j);
  int64_t sizes[2] = {ROWS, COLS};
  tw_layout_t contiguous, transposed;
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &contiguous));
  transposed = contiguous;
  transposed.sizes[0] = COLS, transposed.sizes[1] = ROWS;
  transposed.strides[0] = 1, transposed.strides[1] = COLS;
  size_t nbytes = tw_segment_len(seg);
  tw_lease_t lease;
  CHECK(tw_peer_export(peer, seg, 0, nbytes, &contiguous, 11, 0, on_release, &released[0], &lease));
  CHECK(tw_peer_export(peer, seg, 0, nbytes, &transposed, 12, 0, on_release, &released[1], NULL));
  expect_message(peer, "verified");
  EXPECT(data[0] == -1.0f);
  wait_released(peer);
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1);
  tw_lease_stats_t s;
  CHECK(tw_peer_stats(peer, &s));
  EXPECT(s.granted == 2 && s.released == 2 && s.live_bytes == 0);
  tw_peer_free(peer);
  int status;
  EXPECT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT(atomic_load(&released[0]) == 1 && atomic_load(&released[1]) == 1);

  /* Phase 2: a child holding 100 leases is SIGKILLed. */
  pid = spawn(child_hold, &peer);
  for (int i = 0; i < HOLD; i++)
    CHECK(tw_peer_export(peer, seg, 0, nbytes, &contiguous, (uint64_t)i, 0, on_release, &released[2 + i], NULL));
  expect_message(peer, "holding");
  for (int i = 0; i < HOLD; i++) EXPECT(atomic_load(&released[2 + i]) == 0);
  EXPECT(kill(pid, SIGKILL) == 0);
  EXPECT(waitpid(pid, &status, 0) == pid);
  wait_released(peer);
  CHECK(tw_peer_stats(peer, &s));
  EXPECT(s.reclaimed == HOLD);
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  EXPECT_ERR(tw_peer_recv(peer, 20000, &t, &m), TW_ERR_PEER_GONE, "peer gone");
  tw_peer_free(peer);
  for (int i = 0; i < HOLD; i++) EXPECT(atomic_load(&released[2 + i]) == 1);
  tw_segment_free(seg);
  printf("two_process: ok (2 verified imports, %d leases reclaimed after SIGKILL)\n", HOLD);
  return 0;
}
