/* Error paths through the C ABI: NULL arguments, a corrupt descriptor, a stale
 * (expired) lease, a too-small segment, an oversized view, calls after the peer is gone,
 * waits that may not wait. Each returns its code and a message that names the problem. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>

#include "common.h"

static atomic_int calls;

struct setup { int fd; tw_peer_t *peer; tw_result_e r; };
static void *connect_side(void *arg) {
  struct setup *s = arg;
  s->r = tw_peer_from_fd(s->fd, NULL, &s->peer);
  return NULL;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sends to a waiting consumer a little later: an export, then ring bytes. */
struct later { tw_peer_t *peer; tw_segment_t *seg; const tw_layout_t *layout; tw_result_e r; };
static void *send_later(void *arg) {
  struct later *l = arg;
  sleep_ms(50);
  l->r = tw_peer_export(l->peer, l->seg, 0, 100, l->layout, 4, 0, NULL, NULL, NULL);
  sleep_ms(50);
  if (l->r == TW_OK) l->r = tw_peer_ring_send_bytes(l->peer, 8, (const uint8_t *)"late", 4, 1000);
  return NULL;
}

int main(void) {
  /* NULL arguments and frees. */
  EXPECT_ERR(tw_segment_new(64, NULL), TW_ERR_NULL_ARGUMENT, "argument `out` is NULL");
  tw_desc_t d;
  EXPECT_ERR(tw_desc_decode(NULL, 10, &d), TW_ERR_NULL_ARGUMENT, "`bytes`");
  EXPECT_ERR(tw_imported_release(NULL), TW_ERR_NULL_ARGUMENT, "`imp`");
  EXPECT_ERR(tw_peer_export(NULL, NULL, 0, 0, NULL, 0, 0, on_release, &calls, NULL), TW_ERR_NULL_ARGUMENT, "`peer`");
  EXPECT(atomic_load(&calls) == 1); /* the callback runs even when the export fails */
  tw_segment_free(NULL);
  tw_peer_free(NULL);
  tw_imported_free(NULL);
  tw_message_free(NULL);
  tw_listener_free(NULL);
  EXPECT(tw_segment_data(NULL) == NULL && tw_segment_len(NULL) == 0 && tw_peer_pid(NULL) == -1);
  EXPECT(strcmp(tw_result_name(TW_ERR_STALE_LEASE), "TW_ERR_STALE_LEASE") == 0);
  EXPECT(strcmp(tw_version(), TENSORWIRE_VERSION) == 0);

  /* Options by name (the torch ops' names and ranges): set, refused with the option's own
   * message (the struct untouched), unknown, NULL. */
  tw_peer_config_t cfg, before;
  CHECK(tw_peer_config_default(&cfg));
  CHECK(tw_peer_config_set_option(&cfg, "max_leases", 7));
  CHECK(tw_peer_config_set_option(&cfg, "window_ms", 250));
  CHECK(tw_peer_config_set_option(&cfg, "ring_bytes", 0)); /* 0: keeps the default */
  EXPECT(cfg.max_leases == 7 && cfg.default_window_ms == 250);
  before = cfg;
  EXPECT_ERR(tw_peer_config_set_option(&cfg, "max_leases", -1), TW_ERR_INVALID_ARGUMENT,
             "tensorwire: max_leases must be in [0, 2^32), got -1");
  EXPECT_ERR(tw_peer_config_set_option(&cfg, "cuda_wait", 3), TW_ERR_INVALID_ARGUMENT, "cuda_wait must be 0 (stream)");
  EXPECT_ERR(tw_peer_config_set_option(&cfg, "max_leasez", 1), TW_ERR_INVALID_ARGUMENT, "no connection option `max_leasez`");
  EXPECT_ERR(tw_peer_config_set_option(&cfg, NULL, 1), TW_ERR_NULL_ARGUMENT, "`name`");
  EXPECT(memcmp(&cfg, &before, sizeof cfg) == 0);

  /* CUDA without a driver: clean errors that say why, and the export's callback runs. */
  if (!tw_cuda_available()) {
    printf("errors: *** GPU checks SKIPPED: no CUDA driver; checking TW_ERR_CUDA_UNAVAILABLE paths ***\n");
    int ndev = -1;
    EXPECT_ERR(tw_cuda_device_count(&ndev), TW_ERR_CUDA_UNAVAILABLE, "no NVIDIA driver");
    EXPECT(ndev == -1);
    uint64_t opens = 99;
    tw_cuda_ipc_cache_stats(&opens, NULL);
    EXPECT(opens == 0);
  }

  /* Descriptors: random bytes, wrong length, a corrupted dtype. */
  uint8_t junk[1024];
  for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(i * 7 + 3);
  EXPECT_ERR(tw_desc_decode(junk, tw_desc_size(), &d), TW_ERR_INVALID_DESCRIPTOR, "bad magic");
  EXPECT_ERR(tw_desc_decode(junk, 17, &d), TW_ERR_INVALID_DESCRIPTOR, "descriptor is 17 bytes");
  int64_t bad_sizes[1] = {-5};
  tw_layout_t layout;
  EXPECT_ERR(tw_layout_contiguous(TW_DTYPE_FLOAT32, bad_sizes, 1, &layout), TW_ERR_INVALID_ARGUMENT, "negative");
  EXPECT_ERR(tw_layout_contiguous(200, bad_sizes, 1, &layout), TW_ERR_INVALID_ARGUMENT, "unknown dtype code 200");

  /* A too-small segment. */
  tw_segment_t *small = NULL, *mapped = NULL;
  CHECK(tw_segment_new(100, &small));
  EXPECT_ERR(tw_segment_from_fd(dup(tw_segment_fd(small)), 4096, &mapped), TW_ERR_INVALID_SEGMENT,
             "segment too small: 4096 bytes needed, memfd has 100");
  EXPECT(mapped == NULL);

  /* A connected pair in this process. */
  int a, b;
  CHECK(tw_socketpair(&a, &b));
  struct setup other = {b, NULL, TW_OK};
  pthread_t th;
  EXPECT(pthread_create(&th, NULL, connect_side, &other) == 0);
  tw_peer_t *producer = NULL;
  CHECK(tw_peer_from_fd(a, NULL, &producer));
  pthread_join(th, NULL);
  CHECK(other.r);
  tw_peer_t *consumer = other.peer;

  int64_t sizes[1] = {25};
  CHECK(tw_layout_contiguous(TW_DTYPE_FLOAT32, sizes, 1, &layout));
  atomic_store(&calls, 0);
  EXPECT_ERR(tw_peer_export(producer, small, 0, 64, &layout, 0, 0, on_release, &calls, NULL), TW_ERR_INVALID_ARGUMENT,
             "view needs 100 bytes of storage, storage has 64");
  EXPECT(atomic_load(&calls) == 1);

  if (!tw_cuda_available()) {
    atomic_store(&calls, 0);
    EXPECT_ERR(tw_peer_export_cuda(producer, 0x70000000, 100, &layout, 0, 1, 0, on_release, &calls, NULL),
               TW_ERR_CUDA_UNAVAILABLE, "no NVIDIA driver");
    EXPECT(atomic_load(&calls) == 1);
    /* A GPU ring needs a driver on the side that owns it. */
    tw_peer_config_t cfg;
    CHECK(tw_peer_config_default(&cfg));
    EXPECT(cfg.cuda_ring_device == -1 && cfg.cuda_ring_slots > 0 && cfg.cuda_ring_slot_bytes >= 4096);
    cfg.cuda_ring_device = 0;
    int c1, c2;
    CHECK(tw_socketpair(&c1, &c2));
    tw_peer_t *ringed = NULL;
    EXPECT_ERR(tw_peer_from_fd(c1, &cfg, &ringed), TW_ERR_CUDA_UNAVAILABLE, "no NVIDIA driver");
    EXPECT(ringed == NULL);
    close(c2);
  }
  /* The config's size: a struct never filled by tw_peer_config_default is refused by
   * name; one of an older header (a shorter size) takes defaults for what it lacks. */
  {
    tw_peer_config_t cfg;
    CHECK(tw_peer_config_default(&cfg));
    EXPECT(cfg.size == sizeof cfg);
    int c1, c2;
    CHECK(tw_socketpair(&c1, &c2));
    tw_peer_t *p = NULL;
    cfg.size = 0;
    EXPECT_ERR(tw_peer_from_fd(c1, &cfg, &p), TW_ERR_INVALID_ARGUMENT, "tw_peer_config_default");
    EXPECT(p == NULL);
    close(c2);
  }
  /* No GPU ring on this connection: clear errors that name the setting. */
  EXPECT_ERR(tw_peer_cuda_ring_send(producer, 0x70000000, &layout, 0, 1, 100), TW_ERR_INVALID_ARGUMENT, "cuda_ring");
  uint64_t ring_tag = 77;
  tw_layout_t ring_layout;
  EXPECT_ERR(tw_peer_cuda_ring_recv(consumer, 100, &ring_tag, &ring_layout, NULL, NULL), TW_ERR_INVALID_ARGUMENT,
             "offered no GPU ring");
  EXPECT(ring_tag == 77);
  EXPECT_ERR(tw_peer_cuda_ring_recv(consumer, 100, NULL, NULL, NULL, NULL), TW_ERR_NULL_ARGUMENT, "`layout`");
  EXPECT_ERR(tw_peer_cuda_ring_recv_finish(consumer, 0x70000000, 100, 0, 100), TW_ERR_INVALID_ARGUMENT,
             "offered no GPU ring");
  EXPECT_ERR(tw_peer_cuda_ring_discard(NULL, 100), TW_ERR_NULL_ARGUMENT, "`peer`");

  /* Waiting, one convention for every blocking call: 0 does not wait (TW_ERR_TIMEOUT at
   * once), a long timeout is not read as 0, a negative one has no limit. */
  tw_imported_t *imp = NULL;
  tw_message_t *msg = NULL;
  tw_ring_message_t *rmsg = NULL;
  tw_segment_t *bell = NULL;
  CHECK(tw_segment_new(64, &bell));
  uint32_t seq = 0;
  CHECK(tw_doorbell_current(bell, 0, &seq));
  char lpath[64];
  snprintf(lpath, sizeof lpath, "/tmp/tw-c-errors-%d.sock", (int)getpid());
  unlink(lpath);
  tw_listener_t *listener = NULL;
  CHECK(tw_listener_bind(lpath, &listener));
  tw_peer_t *accepted = NULL;
  double t0 = now_s();
  EXPECT_ERR(tw_peer_recv(consumer, 0, &imp, &msg), TW_ERR_TIMEOUT, "timed out at once");
  EXPECT_ERR(tw_peer_ring_recv(consumer, 0, false, &rmsg), TW_ERR_TIMEOUT, "timed out at once");
  EXPECT_ERR(tw_doorbell_wait(bell, 0, seq, 1000, 0), TW_ERR_TIMEOUT, "timed out at once");
  EXPECT_ERR(tw_listener_accept(listener, 0, NULL, &accepted), TW_ERR_TIMEOUT, "a connection");
  EXPECT(now_s() - t0 < 1.0);
  EXPECT(imp == NULL && msg == NULL && rmsg == NULL && accepted == NULL);
  tw_listener_free(listener);
  tw_segment_free(bell);
  struct later later = {producer, small, &layout, TW_OK};
  EXPECT(pthread_create(&th, NULL, send_later, &later) == 0);
  CHECK(tw_peer_recv(consumer, INT64_MAX, &imp, &msg));
  EXPECT(imp != NULL && tw_imported_tag(imp) == 4);
  CHECK(tw_imported_release(imp));
  CHECK(tw_peer_ring_recv(consumer, -1, false, &rmsg));
  EXPECT(tw_ring_message_tag(rmsg) == 8);
  tw_ring_message_free(rmsg);
  pthread_join(th, NULL);
  CHECK(later.r);

  /* The corrupted descriptor of a real import. */
  CHECK(tw_peer_export(producer, small, 0, 100, &layout, 5, 0, NULL, NULL, NULL));
  CHECK(tw_peer_recv(consumer, 10000, &imp, &msg));
  EXPECT(imp != NULL);
  uint8_t wire[1024];
  EXPECT(tw_desc_size() <= sizeof wire);
  CHECK(tw_desc_encode(tw_imported_desc(imp), wire, sizeof wire));
  CHECK(tw_desc_decode(wire, tw_desc_size(), &d));
  wire[6] = 200; /* dtype */
  EXPECT_ERR(tw_desc_decode(wire, tw_desc_size(), &d), TW_ERR_INVALID_DESCRIPTOR, "unknown dtype code 200");
  CHECK(tw_imported_release(imp));

  /* A stale lease: its 50 ms window runs out before the consumer releases. */
  atomic_store(&calls, 0);
  CHECK(tw_peer_export(producer, small, 0, 100, &layout, 6, 50, on_release, &calls, NULL));
  CHECK(tw_peer_recv(consumer, 10000, &imp, &msg));
  sleep_ms(300);
  EXPECT(atomic_load(&calls) == 1);
  EXPECT_ERR(tw_imported_release(imp), TW_ERR_STALE_LEASE, "expired (its window ran out)");

  /* The producer goes away: the consumer's next calls say so. */
  CHECK(tw_peer_export(producer, small, 0, 100, &layout, 7, 0, NULL, NULL, NULL));
  CHECK(tw_peer_recv(consumer, 10000, &imp, &msg));
  tw_peer_free(producer);
  EXPECT(((const float *)tw_imported_data(imp))[0] == 0.0f); /* still mapped */
  EXPECT_ERR(tw_imported_release(imp), TW_ERR_PEER_GONE, "peer gone");
  EXPECT_ERR(tw_peer_recv(consumer, 10000, &imp, &msg), TW_ERR_PEER_GONE, "peer gone");
  tw_peer_free(consumer);
  tw_segment_free(small);
  printf("errors: ok\n");
  return 0;
}
