/* The ring through the C ABI, between two processes: bytes and a transposed view go
 * parent -> child (packed on the way), the child checks the descriptor and the packed
 * elements, receives borrowed and copied messages, and echoes a chunked message (larger
 * than the ring) back. A connection without a ring reports that clearly. */
#define _GNU_SOURCE
#include "common.h"

#define BIG (3 * 65536 + 123)

static tw_peer_config_t config(void) {
  tw_peer_config_t c;
  CHECK(tw_peer_config_default(&c));
  c.ring_bytes = 65536;
  return c;
}

static tw_ring_message_t *recv_msg(tw_peer_t *peer, bool borrow) {
  tw_ring_message_t *m = NULL;
  CHECK(tw_peer_ring_recv(peer, 20000, borrow, &m));
  return m;
}

static int child(int fd) {
  tw_peer_config_t c = config();
  tw_peer_t *peer = NULL;
  CHECK(tw_peer_from_fd(fd, &c, &peer));
  /* 1: bytes, borrowed in place. */
  tw_ring_message_t *m = recv_msg(peer, true);
  size_t len = 0;
  const char *d = tw_ring_message_data(m, &len);
  EXPECT(tw_ring_message_tag(m) == 1 && len == 5 && memcmp(d, "hello", 5) == 0);
  EXPECT(tw_ring_message_is_borrowed(m) && tw_ring_message_desc(m) == NULL);
  tw_ring_message_free(m);
  /* 2: a transposed int32 [3, 4] view, packed: element (i, j) of the view = 10*j + i. */
  m = recv_msg(peer, false);
  const tw_desc_t *desc = tw_ring_message_desc(m);
  EXPECT(desc != NULL && !tw_ring_message_is_borrowed(m));
  tw_layout_t l;
  CHECK(tw_desc_layout(desc, &l));
  EXPECT(l.dtype == TW_DTYPE_INT32 && l.ndim == 2 && l.sizes[0] == 4 && l.sizes[1] == 3 && l.strides[0] == 3);
  const int32_t *v = tw_ring_message_data(m, &len);
  EXPECT(len == 12 * sizeof(int32_t));
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) EXPECT(v[i * 3 + j] == 10 * j + i);
  tw_ring_message_free(m);
  /* 3: a message 3x the ring, echoed back. */
  m = recv_msg(peer, true);
  const uint8_t *big = tw_ring_message_data(m, &len);
  EXPECT(len == BIG && !tw_ring_message_is_borrowed(m));
  CHECK(tw_peer_ring_send_bytes(peer, 3, big, len, 20000));
  tw_ring_message_free(m);
  expect_peer_gone(peer);
  tw_peer_free(peer);
  return 0;
}

/* A peer that offers no ring. */
static int child_without_ring(int fd) {
  tw_peer_config_t none = config();
  none.ring_bytes = 0;
  tw_peer_t *p = NULL;
  CHECK(tw_peer_from_fd(fd, &none, &p));
  tw_peer_free(p);
  return 0;
}

int main(void) {
  tw_peer_config_t c = config();
  tw_peer_t *peer = NULL;
  pid_t pid = spawn_peer(child, &c, &peer);
  CHECK(tw_peer_ring_send_bytes(peer, 1, (const uint8_t *)"hello", 5, 20000));
  int32_t storage[12];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++) storage[i * 4 + j] = 10 * i + j;
  int64_t sizes[2] = {3, 4};
  tw_layout_t l;
  CHECK(tw_layout_contiguous(TW_DTYPE_INT32, sizes, 2, &l));
  l.sizes[0] = 4, l.sizes[1] = 3, l.strides[0] = 1, l.strides[1] = 4; /* transpose */
  CHECK(tw_peer_ring_send_view(peer, 2, storage, sizeof storage, &l, 20000));
  EXPECT_ERR(tw_peer_ring_send_view(peer, 9, storage, 8, &l, 20000), TW_ERR_INVALID_ARGUMENT, "view needs 48 bytes");
  static uint8_t big[BIG];
  for (size_t i = 0; i < BIG; i++) big[i] = (uint8_t)(i * 7);
  CHECK(tw_peer_ring_send_bytes(peer, 3, big, BIG, 20000));
  tw_ring_message_t *m = recv_msg(peer, false);
  size_t len = 0;
  const uint8_t *back = tw_ring_message_data(m, &len);
  EXPECT(tw_ring_message_tag(m) == 3 && len == BIG && memcmp(back, big, BIG) == 0);
  tw_ring_message_free(m);
  tw_ring_message_free(NULL);
  tw_peer_free(peer);
  expect_child_ok(pid);

  /* Without a ring. */
  c.ring_bytes = 0;
  pid = spawn_peer(child_without_ring, &c, &peer);
  EXPECT_ERR(tw_peer_ring_send_bytes(peer, 1, (const uint8_t *)"x", 1, 100), TW_ERR_INVALID_ARGUMENT, "no ring");
  EXPECT_ERR(tw_peer_ring_recv(peer, 100, false, &m), TW_ERR_INVALID_ARGUMENT, "no ring to receive from");
  tw_peer_free(peer);
  expect_child_ok(pid);
  printf("ring: ok\n");
  return 0;
}
