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

#include "common.h"

#define ROWS 16
#define COLS 32

static atomic_int released;
static atomic_int relay_callbacks; /* in the relay process */


static int last(int up_fd) {
  tw_peer_t *up = NULL;
  CHECK(tw_peer_from_fd(up_fd, NULL, &up));
  tw_imported_t *t = expect_tensor(up);
  tw_layout_t l;
  CHECK(tw_imported_layout(t, &l));
  EXPECT(l.ndim == 2 && l.sizes[0] == ROWS && l.sizes[1] == COLS && tw_imported_tag(t) == 9);
  float *p = tw_imported_data(t);
  EXPECT(p[3 * COLS + 5] == matrix_value(3, 5));
  p[0] = -7.0f; /* the first process must see this */
  send_text(up, "written");
  expect_message(up, "release");
  CHECK(tw_imported_release(t));
  send_text(up, "released");
  expect_peer_gone(up);
  tw_peer_free(up);
  return 0;
}

static int relay(int host_fd) {
  tw_peer_t *host = NULL, *down = NULL;
  pid_t pid = spawn_peer(last, NULL, &down);
  CHECK(tw_peer_from_fd(host_fd, NULL, &host));
  tw_imported_t *imp = expect_tensor(host);
  /* A view needing one element more than the storage: refused, callback already run. */
  tw_layout_t big;
  int64_t sizes[2] = {ROWS, COLS + 1};
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 2, &big));
  EXPECT_ERR(tw_peer_export_imported(down, imp, &big, 1, 0, on_release, &relay_callbacks, NULL),
             TW_ERR_INVALID_ARGUMENT, "view needs");
  EXPECT(atomic_load(&relay_callbacks) == 1);
  CHECK(tw_peer_export_imported(down, imp, NULL, 9, 0, on_release, &relay_callbacks, NULL));
  /* The forward's lease holds the import now: freeing our handle releases nothing. */
  tw_imported_free(imp);
  expect_message(down, "written");
  send_text(host, "holding");
  expect_message(host, "go");
  send_text(down, "release");
  expect_message(down, "released");
  tw_lease_stats_t s = wait_released(down, 10000);
  EXPECT(s.released == 1 && atomic_load(&relay_callbacks) == 2);
  send_text(host, "forwarded");
  expect_message(host, "bye");
  tw_peer_free(down);
  expect_child_ok(pid);
  tw_peer_free(host);
  return 0;
}

int main(void) {
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(relay, NULL, &peer);
  tw_layout_t l;
  tw_segment_t *seg = matrix_segment(ROWS, COLS, &l);
  float *data = tw_segment_data(seg);
  CHECK(tw_peer_export(peer, seg, 0, tw_segment_len(seg), &l, 4, 0, on_release, &released, NULL));
  expect_message(peer, "holding");
  EXPECT(data[0] == -7.0f);
  expect_forward_held_then_released(peer, &released);
  send_text(peer, "bye");
  expect_child_ok(pid);
  tw_peer_free(peer);
  EXPECT(atomic_load(&released) == 1);
  tw_segment_free(seg);
  printf("forward: ok (host -> relay -> last, one memory, released once)\n");
  return 0;
}
