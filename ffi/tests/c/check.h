/* Tiny assertion helpers shared by the C tests. */
#ifndef TW_TEST_CHECK_H
#define TW_TEST_CHECK_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tensorwire.h"

#define CHECK(call)                                                                     \
  do {                                                                                  \
    tw_result_e r_ = (call);                                                            \
    if (r_ != TW_OK) {                                                                  \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call,               \
              tw_result_name(r_), tw_last_error_message());                             \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

#define EXPECT(cond)                                                                    \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);               \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* `call` must fail with `code`, and the thread's last error must contain `needle`. */
#define EXPECT_ERR(call, code, needle)                                                  \
  do {                                                                                  \
    tw_result_e r_ = (call);                                                            \
    if (r_ != (code) || strstr(tw_last_error_message(), (needle)) == NULL) {            \
      fprintf(stderr, "%s:%d: %s -> %s (%s), expected %s containing \"%s\"\n",          \
              __FILE__, __LINE__, #call, tw_result_name(r_), tw_last_error_message(),   \
              tw_result_name(code), (needle));                                          \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

#endif
