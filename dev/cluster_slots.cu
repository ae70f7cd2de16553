// cluster_slots.cu — how many CTA slots clusters of k CTAs can fill on this GPU (dev/NOTES.md,
// "What bounds the remaining cells, and linear CE measured in turns"): cudaOccupancyMaxActiveClusters for CTAs limited to 1-4 per SM (by dynamic shared
// memory) and k = 1..16, as a share of SMs x CTAs per SM. Clusters live inside one GPC, so sizes
// that do not divide a GPC's slots leave some idle.
//   nvcc -arch=sm_90 -o /tmp/cluster_slots dev/cluster_slots.cu && /tmp/cluster_slots
#include <cstdio>
#include <cuda_runtime.h>
__global__ void __launch_bounds__(1024) dummy(int* p) { extern __shared__ int s[]; if (p) p[threadIdx.x] = s[0]; }
int main() {
  int sms = 0; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  int smem_sm = 0; cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0);
  cudaFuncSetAttribute(dummy, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  cudaFuncSetAttribute(dummy, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  printf("SMs %d, smem/SM %d\n", sms, smem_sm);
  for (int per_sm : {1, 2, 3, 4}) {
    size_t smem = (smem_sm / per_sm) - 2048;
    if (smem > 200 * 1024) smem = 200 * 1024;
    printf("CTAs/SM %d (smem %zu):", per_sm, smem);
    for (int k = 1; k <= 16; ++k) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim.x = k; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
      cfg.gridDim = dim3(k * 64); cfg.blockDim = dim3(256); cfg.dynamicSmemBytes = smem;
      cfg.attrs = &attr; cfg.numAttrs = 1;
      int clusters = 0;
      cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, dummy, &cfg);
      if (e != cudaSuccess) { printf(" k%d:err", k); cudaGetLastError(); continue; }
      printf(" k%d:%d(%.1f%%)", k, clusters, 100.0 * clusters * k / (sms * per_sm));
    }
    printf("\n");
  }
}
