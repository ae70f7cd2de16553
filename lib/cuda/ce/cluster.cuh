// ce/cluster.cuh — the register path's exchange between the CTAs of a cluster (sm_90): the
// mbarrier and st.async of the partials, and the cluster barriers. Part of ce/device.cuh (it
// includes this file where these functions belong; include device.cuh, not this file).
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The register path's exchange of the k partials of a row without a cluster barrier: every CTA
// stores its partial into slot `rank` of every CTA of the cluster (itself included) with
// st.async, which completes a transaction on that CTA's mbarrier; each CTA waits on its own
// mbarrier for k·16 bytes. No fence or barrier on the way (the transaction completion orders
// the stores before the wait returns); the mbarrier is initialised once, before a cluster
// barrier that its first remote store waits for (mbar_init / cluster_arrive_relaxed at the
// start, cluster_wait before the first exchange).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// An mbarrier of `count` arrivals per phase; mbar_init_fence makes the initialisations visible
// (to the cluster, and to the bulk-copy engine) before any use.
__device__ __forceinline__ void mbar_init_count(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  mbar_init_count(bar, 1);
  mbar_init_fence();
}
// This CTA's arrival on its own mbarrier, expecting `bytes` of remote stores in this phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes) : "memory");
}
// 16 bytes (a Partial) into `slot` of CTA `rank` of the cluster, completing on its `bar`.
__device__ __forceinline__ void st_async_partial(const Partial& v, const Partial* slot,
                                                 const uint64_t* bar, int rank) {
  uint32_t rslot, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rslot) : "r"(smem_addr(slot)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(smem_addr(bar)), "r"(rank));
  const uint64_t sw = static_cast<uint64_t>(__double_as_longlong(v.sw));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
      ::"r"(rslot), "r"(__float_as_uint(v.m)), "r"(__float_as_uint(v.s)), "r"(uint32_t(sw)),
      "r"(uint32_t(sw >> 32)), "r"(rbar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}

// Release/acquire: the CTA's partial (shared memory) becomes visible to the cluster.
__device__ __forceinline__ void cluster_sync_release_acquire() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// "Done reading the others' shared memory" (the values read are already consumed): no fence.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}
#endif
