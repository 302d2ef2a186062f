/* Forwarding through the C ABI, three processes: the parent exports a float32 matrix to
 * a relay (forked), which forwards the import to a last process (forked) with
 * tw_peer_export_imported and frees its own handle at once; the last writes through its
 * mapping, holds it while the parent checks that its lease is still live, then releases.
 * The parent must see the write (one memory, no copy), and its release callback must run
 * exactly once — only after the last released. A view that
 * does not fit the import is refused in the relay, its callback run before the call
 * returns. */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define ROWS 16
#define COLS 32

static atomic_int released;
static int relay_callbacks; /* in the relay process */

static void on_release(void *ctx) { atomic_fetch_add((atomic_int *)ctx, 1); }
static void on_relay_release(void *ctx) { ++*(int *)ctx; }

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

static void send_text(tw_peer_t *peer, const char *s) {
  CHECK(tw_peer_send_message(peer, (const uint8_t *)s, strlen(s), NULL, 0));
}

static int last(int up_fd) {
  tw_peer_t *up = NULL;
  CHECK(tw_peer_from_fd(up_fd, NULL, &up));
  tw_imported_t *t = expect_tensor(up);
  tw_layout_t l;
  CHECK(tw_imported_layout(t, &l));
  EXPECT(l.ndim == 2 && l.sizes[0] == ROWS && l.sizes[1] == COLS && tw_imported_tag(t) == 9);
  float *p = tw_imported_data(t);
  EXPECT(p[3 * COLS + 5] == 3005.0f);
  p[0] = -7.0f; /* the first process must see this */
  send_text(up, "written");
  expect_message(up, "release");
  CHECK(tw_imported_release(t));
  send_text(up, "released");
  tw_message_t *m = NULL;
  t = NULL;
  EXPECT(tw_peer_recv(up, 20000, &t, &m) == TW_ERR_PEER_GONE);
  tw_peer_free(up);
  return 0;
}

static int relay(int host_fd) {
  int a, b;
  CHECK(tw_socketpair(&a, &b));
  pid_t pid = fork();
  EXPECT(pid >= 0);
  if (pid == 0) {
    close(a);
    _exit(last(b));
  }
  close(b);
  tw_peer_t *host = NULL, *down = NULL;
  CHECK(tw_peer_from_fd(host_fd, NULL, &host));
  CHECK(tw_peer_from_fd(a, NULL, &down));
  tw_imported_t *imp = expect_tensor(host);
  /* A view needing one element more than the storage: refused, callback already run. */
  tw_layout_t big;
  int64_t sizes[2] = {ROWS, COLS + 1};
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &big));
  EXPECT_ERR(tw_peer_export_imported(down, imp, &big, 1, 0, on_relay_release, &relay_callbacks, NULL),
             TW_ERR_INVALID_ARGUMENT, "view needs");
  EXPECT(relay_callbacks == 1);
  CHECK(tw_peer_export_imported(down, imp, NULL, 9, 0, on_relay_release, &relay_callbacks, NULL));
  /* The forward's lease holds the import now: freeing our handle releases nothing. */
  tw_imported_free(imp);
  expect_message(down, "written");
  send_text(host, "holding");
  expect_message(host, "go");
  send_text(down, "release");
  expect_message(down, "released");
  tw_lease_stats_t s;
  for (int i = 0; i < 2000; i++) {
    CHECK(tw_peer_reap(down, &s));
    if (s.live_leases == 0) break;
    sleep_ms(5);
  }
  EXPECT(s.live_leases == 0 && s.released == 1 && relay_callbacks == 2);
  send_text(host, "forwarded");
  expect_message(host, "bye");
  tw_peer_free(down);
  int status;
  EXPECT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  tw_peer_free(host);
  return 0;
}

int main(void) {
  int a, b;
  CHECK(tw_socketpair(&a, &b));
  pid_t pid = fork();
  EXPECT(pid >= 0);
  if (pid == 0) {
    close(a);
    _exit(relay(b));
  }
  close(b);
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(a, NULL, &peer));
  tw_segment_t *seg = NULL;
  CHECK(tw_segment_new(ROWS * COLS * sizeof(float), &seg));
  float *data = tw_segment_data(seg);
  for (int i = 0; i < ROWS; i++)
    for (int j = 0; j < COLS; j++) data[i * COLS + j] = (float)(i * 1000 + j);
  int64_t sizes[2] = {ROWS, COLS};
  tw_layout_t l;
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &l));
  CHECK(tw_peer_export(peer, seg, 0, tw_segment_len(seg), &l, 4, 0, on_release, &released, NULL));
  expect_message(peer, "holding");
  EXPECT(data[0] == -7.0f);
  /* The last holds the forward: the relay's import, and so our lease, must stay. */
  sleep_ms(30);
  tw_lease_stats_t s;
  CHECK(tw_peer_reap(peer, &s));
  EXPECT(s.live_leases == 1 && atomic_load(&released) == 0);
  send_text(peer, "go");
  expect_message(peer, "forwarded");
  for (int i = 0; i < 2000; i++) {
    CHECK(tw_peer_reap(peer, &s));
    if (s.live_leases == 0) break;
    sleep_ms(5);
  }
  EXPECT(s.live_leases == 0 && s.released == 1 && atomic_load(&released) == 1);
  send_text(peer, "bye");
  int status;
  EXPECT(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  tw_peer_free(peer);
  EXPECT(atomic_load(&released) == 1);
  tw_segment_free(seg);
  printf("forward: ok (host -> relay -> last, one memory, released once)\n");
  return 0;
}
