/* Links tensorwire through find_package and round-trips a descriptor of a segment. */
#include <stdio.h>
#include <string.h>
#include "tensorwire.h"

int main(void) {
  tw_segment_t *seg = NULL;
  if (tw_segment_new(4096, &seg) != TW_OK) return 1;
  int64_t sizes[2] = {16, 16};
  tw_layout_t layout;
  uint64_t extent = 0;
  if (tw_layout_contiguous(TW_DTYPE_FLOAT64, sizes, 2, &layout) != TW_OK) return 2;
  if (tw_layout_extent_bytes(&layout, &extent) != TW_OK || extent != 16 * 16 * 8) return 3;
  if (extent > tw_segment_len(seg)) return 4;
  if (strcmp(tw_version(), TENSORWIRE_VERSION) != 0) return 5;
  tw_segment_free(seg);
  printf("consumer: linked tensorwire %s, extent %llu bytes\n", tw_version(), (unsigned long long)extent);
  return 0;
}
