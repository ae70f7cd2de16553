/* Built against an installed libfusedce_nccl (when the install has it), by CMake's find_package
 * (FusedCE::fusedce_nccl) and by pkg-config (fusedce_nccl). Needs no GPU: the library's version,
 * its build line and an argument check that fails before NCCL or a device is touched. */
#include <fusedce_nccl.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  fce_vp_shard shard;
  fce_status s = fce_nccl_shard(NULL, 8, 0, 8, &shard);
  printf("installed fusedce_nccl %u (fusedce %u): %s\n  NULL comm: status %d, \"%s\"\n",
         fce_nccl_version(), fce_version(), fce_nccl_build_info(), s, fce_nccl_last_error());
  return fce_nccl_version() == fce_version() && s == FCE_ERROR_NULL_POINTER &&
                 strstr(fce_nccl_last_error(), "comm is NULL") != NULL
             ? 0
             : 1;
}
