/* Built against an installed fusedce, by CMake's find_package and by pkg-config. */
#include <fusedce.h>
#include <stdio.h>

int main(void) {
  fce_options opt = FCE_OPTIONS_INIT;
  opt.backend = FCE_BACKEND_CPU;
  float z[2 * 3] = {1, 2, 3, 3, 2, 1}, loss = -1;
  long long y[2] = {2, 0};
  size_t ws = 0;
  if (fce_forward_workspace_size(&opt, 2, 3, &ws) != FCE_SUCCESS || ws > 0) return 1;
  fce_outputs out = FCE_OUTPUTS_INIT;
  out.loss = &loss;
  fce_status s = fce_forward(&opt, 2, 3, z, y, &out, NULL, NULL, 0, NULL);
  printf("installed fusedce %u: status %d, loss %.6f (expected 0.407606)\n", fce_version(), s, loss);
  return s == FCE_SUCCESS && loss > 0.4075f && loss < 0.4077f ? 0 : 1;
}
