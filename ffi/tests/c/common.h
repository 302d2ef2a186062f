/* Scaffolding shared by the C tests: the assertion macros (check.h), a forked child with
 * a connection to it, waiting for a child, for leases to end and for the peer to hang up,
 * the expectations every test makes of what the peer sends, and the release callback
 * they export with. Each test defines _GNU_SOURCE before including it. */
#ifndef TW_TEST_COMMON_H
#define TW_TEST_COMMON_H
#include <stdatomic.h>
#include <stdbool.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

/* How long any wait for the peer may take before the test fails (ms). */
#define TW_TEST_TIMEOUT_MS 20000

/* The release callback of the tests' exports: counts its calls in the atomic_int `ctx`
 * (it may run on any thread). */
static inline void on_release(void *ctx) { atomic_fetch_add((atomic_int *)ctx, 1); }

static inline void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Fork a child that runs `child(fd)` on its end of a new socketpair and exits with its
 * result; returns its pid, and our end in `*fd`. */
static inline pid_t spawn_child(int (*child)(int), int *fd) {
  int a, b;
  CHECK(tw_socketpair(&a, &b));
  pid_t pid = fork();
  EXPECT(pid >= 0);
  if (pid == 0) {
    close(a);
    _exit(child(b));
  }
  close(b);
  *fd = a;
  return pid;
}

/* `spawn_child`, and our end made a peer (`cfg` NULL: the defaults) that must name the
 * child as its peer process. */
static inline pid_t spawn_peer(int (*child)(int), const tw_peer_config_t *cfg, tw_peer_t **peer) {
  int fd;
  pid_t pid = spawn_child(child, &fd);
  CHECK(tw_peer_from_fd(fd, cfg, peer));
  EXPECT(tw_peer_pid(*peer) == pid);
  return pid;
}

/* Reap `pid`, which must have exited with status 0. */
static inline void expect_child_ok(pid_t pid) {
  int status;
  EXPECT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* Reap released leases until none is live; fails after `timeout_ms`. Returns the stats. */
static inline tw_lease_stats_t wait_released(tw_peer_t *peer, int timeout_ms) {
  tw_lease_stats_t s;
  for (int waited = 0;; waited += 5) {
    CHECK(tw_peer_reap(peer, &s));
    if (s.live_leases == 0) return s;
    if (waited >= timeout_ms) break;
    sleep_ms(5);
  }
  fprintf(stderr, "leases still live after %d ms: %llu\n", timeout_ms, (unsigned long long)s.live_leases);
  exit(1);
}

/* The next message from the peer must be the user message `want`. */
static inline void expect_message(tw_peer_t *peer, const char *want) {
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  CHECK(tw_peer_recv(peer, TW_TEST_TIMEOUT_MS, &t, &m));
  EXPECT(t == NULL && m != NULL);
  size_t len = 0;
  const uint8_t *data = tw_message_data(m, &len);
  if (len != strlen(want) || memcmp(data, want, len) != 0) {
    fprintf(stderr, "expected the message \"%s\", got \"%.*s\"\n", want, (int)len, (const char *)data);
    exit(1);
  }
  tw_message_free(m);
}

/* The next message from the peer must be a tensor; returns its import. */
static inline tw_imported_t *expect_tensor(tw_peer_t *peer) {
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  CHECK(tw_peer_recv(peer, TW_TEST_TIMEOUT_MS, &t, &m));
  EXPECT(t != NULL && m == NULL);
  return t;
}

/* Wait for the peer to hang up: the next receive must say it is gone. */
static inline void expect_peer_gone(tw_peer_t *peer) {
  tw_imported_t *t = NULL;
  tw_message_t *m = NULL;
  EXPECT_ERR(tw_peer_recv(peer, TW_TEST_TIMEOUT_MS, &t, &m), TW_ERR_PEER_GONE, "peer gone");
}

static inline void send_text(tw_peer_t *peer, const char *s) {
  CHECK(tw_peer_send_message(peer, (const uint8_t *)s, strlen(s), NULL, 0));
}

/* The first process's half of a forward through a relay to a last process (forward.c,
 * cuda_forward.c), after the relay said "holding": the last holds the forward, so the
 * relay's import, and with it our one lease, must stay (its callback, counted in
 * `released`, not run); then "go", and once the relay says "forwarded" the lease must be
 * back, its callback run once. */
static inline void expect_forward_held_then_released(tw_peer_t *peer, atomic_int *released) {
  sleep_ms(30);
  tw_lease_stats_t s;
  CHECK(tw_peer_reap(peer, &s));
  EXPECT(s.live_leases == 1 && atomic_load(released) == 0);
  send_text(peer, "go");
  expect_message(peer, "forwarded");
  s = wait_released(peer, TW_TEST_TIMEOUT_MS);
  EXPECT(s.released == 1 && atomic_load(released) == 1);
}

/* Element (i, j) of the matrices the tests share. */
static inline float matrix_value(int i, int j) { return (float)(i * 1000 + j); }

/* A new segment holding a float32 `rows` x `cols` matrix of `matrix_value`s, and its
 * contiguous layout in `*layout`. */
static inline tw_segment_t *matrix_segment(int rows, int cols, tw_layout_t *layout) {
  tw_segment_t *seg = NULL;
  CHECK(tw_segment_new((size_t)rows * (size_t)cols * sizeof(float), &seg));
  float *data = tw_segment_data(seg);
  for (int i = 0; i < rows; i++)
    for (int j = 0; j < cols; j++) data[i * cols + j] = matrix_value(i, j);
  int64_t sizes[2] = {rows, cols};
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, layout));
  return seg;
}

/* The transpose of a contiguous 2-d layout: a view of the same storage. */
static inline tw_layout_t transposed(tw_layout_t l) {
  int64_t rows = l.sizes[0], cols = l.sizes[1];
  l.sizes[0] = cols, l.sizes[1] = rows;
  l.strides[0] = 1, l.strides[1] = cols;
  return l;
}

#endif
