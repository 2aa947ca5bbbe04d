// A chain of dependent GEMVs at one row (batch 1's projections) in one persistent CUDA launch, each block
// streaming its weight rows of the stages ahead into shared memory (cp.async) while it waits for the grid at the
// stage in front: issue 4's experiment towards a batch-1 megakernel, in the form Triton cannot express
// (kestrel/ops/linear/triton_chain.py: Triton neither pipelines a load across a wait nor lets a program keep more
// than one stage's slice in flight). Not on the model's path; cuda_chain.py builds and drives it.
//
// Layout (as GemvChain's): weights one flat bf16 buffer, activations another, stage s's entries in meta[s]:
// weight offset, input offset, (input row stride, unused at one row), output offset, N, K, in elements. Stage s
// reads the K_s values at its input offset (the chain's input, or the first K_s outputs of stage s - 1) and
// writes N_s outputs, each an fp32 sum rounded once to bf16.
//
// Block b owns rows [N * b / G, N * (b + 1) / G) of every stage (G blocks, all resident: one a streaming
// multiprocessor, so the grid barrier holds). Its shared memory is a ring of 16-byte units: the rows of stage s
// are copied in with cp.async as one commit group, in stage order, as far ahead as the ring has room and `depth`
// allows; a stage's units are freed once the block has summed them. At stage s the block (1) issues the stages
// that now fit, (2) waits at the grid barrier for stage s - 1's outputs (thread 0 polls the counter with acquiring
// loads), (3) reads its input into registers (each lane 8 bf16 a 16-byte unit, the units lane, lane + 32, ...),
// (4) waits for its own copies of stage s (cp.async.wait_group) and the block's, (5) sums each row (a warp a row,
// a warp shuffle tree), lane 0 storing the rounded output, (6) arrives: __syncthreads, then thread 0 fences and
// adds one to the counter (the pattern of cooperative groups' grid sync). A poll past max_spin sets *gave_up and
// goes on (a grid not all resident: wrong results, no hang).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <climits>

namespace {

constexpr int kThreads = 512;  // 16 warps
constexpr int kWarps = kThreads / 32;
constexpr int kMaxUnitsPerLane = 8;  // K up to 32 lanes x 8 units x 8 values = 2048
constexpr int kMeta = 6;
// mode bits (timing variants): warp 0 issues no copies; the arrival a release add instead of a fence and an add;
// no barrier at all (wrong results: what the weight stream and the sums take without the waits)
constexpr int kCopyApart = 1, kRelease = 2, kNoBarrier = 4;
// kTma: a stage's rows come in as bulk copies (the TMA unit, at most kBulkBytes each) completing on the stage's
// mbarrier, issued by thread 32, instead of 16-byte cp.async from every thread. kLL: no counter: each output also
// goes out as an LL pair (flag = stage + 1) and the next stage's blocks poll their input's pairs until every flag
// is theirs, through shared memory (the LL buffer zeroed before each launch).
constexpr int kTma = 8, kLL = 16, kPipe = 32;
// pipe's timing variants: the consumers only wait for each page and free it (kNoCompute: what the stream alone
// takes); four producer lanes, each issuing every fourth page (kProducers4)
constexpr int kNoCompute = 64, kProducers4 = 128;
constexpr int kNoInput = 256;  // pipe without its input's read (zeros: wrong results; what the read costs)
// pipe with each page owned by one consumer warp (its slot's: slot % 15), which alone waits for it, sums its rows
// four at a time (four independent chains of fmas) and frees it: after Nsight Compute found the sums latency-bound,
// a row at a time a warp, with every warp polling every page. (Session 61 timed it with page g owned by warp
// g % 15, which is wrong once a stage has more pages than the ring has slots: mma_consume says why; its runs had
// fewer, and their outputs matched.)
constexpr int kOwnPages = 512;
// pipe with no stream: the producer completes each page's mbarrier without copying anything (the consumers sum
// whatever the ring holds: wrong results; what the consumers' own work takes)
constexpr int kNoStream = 1024;
// pipe with the sums on the tensor cores: a page is a tile of 16 rows x kc columns (kc = page_bytes / 32), each
// row a bulk copy into its own line of the page, 16 bytes apart from the next (conflict-free ldmatrix); the page's
// owner warp (its slot's: slot % 15) sums it with mma.sync m16n8k16 (the input as all 8 columns of B) and writes its
// 16 partial sums to shared memory; once the stage's pages are all in, each row adds its pages' sums in column
// order (the same result every run: no atomics) and is stored. After
// Nsight Compute's count: 126 M warp instructions, most of them the sums' and polls' (8 weights a lane an LDS, 8
// conversions and 8 fmas), where an mma takes 256 weights for an ldmatrix, an 8-byte load and itself.
constexpr int kMma = 2048;
// kMma with its page's row copies spread over the producer warp's lanes (lane i the page's row i, after lane 0 has
// waited for the slot and set its byte count) where lane 0 alone issues all 16: whether one lane's copies hold the
// stream back
constexpr int kMmaLanes = 4096;
// kMma with the weights packed on the host in the order the producer streams them (cuda_chain.py's
// pack_mma_pages): a page's rows contiguous, each row's 16-byte units swizzled (unit u of row i at u ^ (i & 7)
// within its group of 8, so ldmatrix's 8 rows fall on 8 bank groups with no padding), a page one bulk copy: where
// the padded lines took a copy a row (session 64, H100: the stream alone 12.2 us a layer with lane 0's 16 copies
// a page, 8.7 with 16 lanes', against 7.6-8.1 for pipe's one copy a page)
constexpr int kMmaPacked = 8192;
// kMma with each page's k-blocks split among 2^p consumer warps (p, in mode bits 14-15: kMmaPartsShift): a stage's
// pages are all summed once its input is in, each by one warp, so a warp's share of a page is the stage's latency
// after its input (session 64: with LL 12.5, 13.6 and 16.7 us a layer with 8, 16 and 32 KB pages). Measured no
// better (call c: 12.3-13.2 with LL against 12.7 undivided; the consumers alone 12.4 with 4 parts against 8.5)
constexpr int kMmaPartsShift = 14;
// kMma with LL: a consumer thread sleeps kPollSleepNs between polls of an input pair not yet there. Every consumer
// thread of every block polls its pairs from L2 while a stage's input is not in (about 60 K 16-byte reads in flight
// over the GPU): whether that traffic holds the weight stream back.
constexpr int kPollSleep = 1 << 16;
constexpr unsigned kPollSleepNs = 128;
// kMma with every mbarrier wait (the pages' full and empty) a spin on test_wait instead of try_wait (mbar_wait):
// whether the suspended waits wake late (session 65: with no stream and no barrier the consumers' page handshakes,
// syncs and stores alone took 5.7 us a layer on an H200)
constexpr int kTestWait = 1 << 17;
// kMmaPacked with a block's last row tile of r < 16 rows folded: its K columns cut into f segments (the largest
// f <= min(8, 16 / r) with K a multiple of 16 f), segment j of row i the tile's virtual row j r + i, so that the
// tile is f r rows of K / f columns, f times fewer pages. The mma takes each segment's input as a column of B (lane
// group gi's: segment gi) and virtual row v's sum is column v / r of C. mini's 4232-row stage over 132 blocks
// leaves 8 blocks a row more than 32: a third tile of one row, 4 pages of it where 1 holds it (8 + 4 + 2 = 14
// pages a layer against a ring of 13 at 16 KB: the stage's last page waits for the slot the stage before frees,
// through the producer; whether those blocks are each stage's last is what the trace tells (session 65: the last
// block's sums 4.5 us against the median's 3.5)
constexpr int kMmaFold = 1 << 18;
// kMmaPacked with a page's sums software-pipelined (mma_load2, mma2): where a page's k-blocks come in whole groups
// of 4, each one swizzle group of 8 units (its columns a multiple of 64: session 69, where 128 had been asked,
// which left 10 KB pages' 320 columns unpipelined), no branch between its loads and its mmas, and the next two
// k-blocks' loads issued before this two's mmas (volatile asm keeps its order, so the compiler cannot move them
// there itself).
// Session 66's trace (H100): a page's sums took 1.3, 2.0 and 3.0 us at 16, 32 and 64 k-blocks, about 65 cycles a
// k-block, where its ldmatrix, 8-byte load and mma should issue in a few
constexpr int kMmaPipelined = 1 << 19;
// kMma with LL: the consumers meet once more after a stage's rows are stored, before any of them polls the next
// stage's input, which cannot be complete before this block's own outputs are out. Call e's trace (session 68,
// H100): 0.41-0.47 us a stage from the second barrier to consumer 0's row stored (four partial sums read from
// shared memory, two stores), while the other 447 consumer threads were already polling the next input from L2
constexpr int kStoreFirst = 1 << 20;
constexpr int kMaxPartials = 2048;  // kMma: a block's rows of one stage x its pages a row (fp32 sums in shared)
constexpr int kMaxStages = 64;  // pipe keeps every stage's entries in shared memory
constexpr unsigned kBulkBytes = 32768;
constexpr int kMaxK = 2048;
constexpr int kGatherBatch = 4;  // a stage's input: the loads a thread issues before it waits for any

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most n of this thread's commit groups are pending (the instruction takes an immediate).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::); break;
  }
}

__device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect(uint32_t bar, unsigned bytes) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// With `spin` (kMma's kTestWait) the phase is polled with test_wait, which never suspends the thread, where
// try_wait may suspend it until the phase completes or a time limit passes.
__device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity, bool spin = false) {
  unsigned ok = 0;
  while (spin && !ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  }
  while (!ok) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
        : "=r"(ok)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

// One bulk copy (the TMA unit): `bytes` (a multiple of 16) from global to shared, completing on `bar`.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, unsigned bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// An LL pair: the value's bits beside the flag of the stage that wrote it, in one 8-byte store (NCCL's LL
// protocol: a reader that sees the flag sees the value, with no fence or counter between them).
__device__ __forceinline__ void st_ll(unsigned long long* p, unsigned flag, unsigned bits) {
  const unsigned long long v = (static_cast<unsigned long long>(bits) << 32) | flag;
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

// Two LL pairs in one 16-byte load, read as two 64-bit elements so that neither pair can tear (a v4.u32 load is
// four 32-bit reads to the memory model, though the hardware does not split an aligned one).
__device__ __forceinline__ uint4 ld_volatile16(const void* p) {
  unsigned long long lo, hi;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];\n" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
  return make_uint4(static_cast<unsigned>(lo), static_cast<unsigned>(lo >> 32), static_cast<unsigned>(hi),
                    static_cast<unsigned>(hi >> 32));
}

__device__ __forceinline__ void red_release_add(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

struct StageRows {
  const __nv_bfloat16* w;  // this block's first weight row
  const __nv_bfloat16* x;  // the stage's input
  __nv_bfloat16* y;        // the stage's output
  int rows, K;             // the block's row count, the width
};

// Block b's first row of a stage of N rows over G blocks (its last is block b + 1's first, less one)
__host__ __device__ constexpr int block_first_row(long long N, int b, int G) { return static_cast<int>(N * b / G); }

// Block b's rows [first, next block's first) of a stage of N rows over G blocks
__device__ __forceinline__ int2 block_row_span(long long N, int b, int G) {
  return make_int2(block_first_row(N, b, G), block_first_row(N, b + 1, G));
}

// Stage s over this block's rows [r0, r1)
__device__ __forceinline__ StageRows stage_rows(const long long* meta, const __nv_bfloat16* w, __nv_bfloat16* acts,
                                                int s, int2 r) {
  const long long* m = meta + s * kMeta;
  const int K = static_cast<int>(m[5]);
  return {w + m[0] + static_cast<long long>(r.x) * K, acts + m[1], acts + m[3] + r.x, r.y - r.x, K};
}

// Block b's rows of stage s (of G blocks)
__device__ __forceinline__ StageRows stage_rows(const long long* meta, const __nv_bfloat16* w,
                                                __nv_bfloat16* acts, int s, int b, int G) {
  return stage_rows(meta, w, acts, s, block_row_span(meta[s * kMeta + 4], b, G));
}

// stage_rows with the block's rows read from its table (rows[s]: its first row of stage s and the next block's),
// worked out once a launch (chain_pipe_kernel's block_rows): two 64-bit divisions a stage in every warp otherwise
__device__ __forceinline__ StageRows stage_rows(const long long* meta, const int2* rows, const __nv_bfloat16* w,
                                                __nv_bfloat16* acts, int s) {
  return stage_rows(meta, w, acts, s, rows[s]);
}

// A stage's input from its LL pairs into xs, bf16 in the input's order (two values a 4-byte store from a 16-byte
// load), each pair polled until both flags are stage s's input's (stage s - 1's outputs carry flag s; stage 0's
// input, the chain's, is plain); threads t0, t0 + step, ... share it. Without `poll` the flags are not waited for
// (kNoBarrier). xs then reads back as 16-byte units with no bank conflicts (input_from_units); as fp32 at
// xs[8u + j], lane u's loads had hit 4 banks, 8 wavefronts each (Nsight Compute, call z: 43 M shared
// wavefronts with LL pairs against 5 M without).
// Where word wi of the input (its values 2wi, 2wi + 1) goes in xs: in order, or (kMma) in each 16 values' 8 words
// as 0 4 1 5 2 6 3 7, so that lane t's B fragment of a k-block (words t and t + 4) is one 8-byte load.
__device__ __forceinline__ int frag_word(int wi, bool frag) {
  return frag ? (wi & ~7) | ((wi & 3) << 1) | ((wi >> 2) & 1) : wi;
}

template <int kBatch = 1>
__device__ __forceinline__ void gather_ll_input(unsigned* xs, const StageRows& st, const __nv_bfloat16* acts,
                                                const unsigned long long* ll, int s, int t0, int step, bool poll,
                                                long long max_spin, int* gave_up, bool frag = false,
                                                unsigned sleep_ns = 0) {
  const long long x_off = st.x - acts;
  if (s == 0) {
    for (int e = 2 * t0; e < st.K; e += 2 * step)
      xs[frag_word(e / 2, frag)] = *reinterpret_cast<const unsigned*>(st.x + e);
    return;
  }
  // kBatch loads in flight a thread before any is polled: one after the other, each is an L2 round trip of its
  // own (three a stage at K 2048 over 480 threads; kMma's pipe takes kGatherBatch, the rest 1: their registers)
  for (int e0 = 2 * t0; e0 < st.K; e0 += 2 * step * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = e0 + 2 * step * i;
      if (e < st.K) v[i] = ld_volatile16(ll + x_off + e);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = e0 + 2 * step * i;
      if (e >= st.K) break;
      long long spins = 0;
      while ((v[i].x != static_cast<unsigned>(s) || v[i].z != static_cast<unsigned>(s)) && poll) {
        if (++spins > max_spin) {
          atomicExch(gave_up, 1);
          break;
        }
        if (sleep_ns) __nanosleep(sleep_ns);
        v[i] = ld_volatile16(ll + x_off + e);
      }
      xs[frag_word(e / 2, frag)] = (v[i].y & 0xffffu) | (v[i].w << 16);
    }
  }
}

// A lane's share of the input in registers: the 8 values of each 16-byte unit lane, lane + 32, ... (zeros past
// KU), from global memory through L2 (written by other blocks this launch: never in this SM's L1) or from shared.
template <bool kGlobal>
__device__ __forceinline__ void input_from_units(float (&x)[kMaxUnitsPerLane][8], const uint4* src, int lane,
                                                 int KU) {
#pragma unroll
  for (int i = 0; i < kMaxUnitsPerLane; ++i) {
    const int u = lane + 32 * i;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (u < KU) v = kGlobal ? __ldcg(src + u) : src[u];
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      x[i][2 * j] = f.x;
      x[i][2 * j + 1] = f.y;
    }
  }
}

// Poll the counter (acquiring) until it reaches `want`; past max_spin polls set *gave_up and go on.
__device__ __forceinline__ void wait_counter(const unsigned* counter, unsigned want, long long max_spin,
                                             int* gave_up) {
  long long spins = 0;
  while (ld_acquire(counter) < want) {
    if (++spins > max_spin) {
      atomicExch(gave_up, 1);
      break;
    }
  }
}

// acc += the 8 weights of unit v times the 8 input values xi.
__device__ __forceinline__ float dot_unit(float acc, uint4 v, const float (&xi)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc = fmaf(f.x, xi[2 * j], acc);
    acc = fmaf(f.y, xi[2 * j + 1], acc);
  }
  return acc;
}

// The warp's sum of `v` (every lane gets it).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Output r of stage s (lane 0's): rounded once, and with kLL as an LL pair too.
__device__ __forceinline__ void store_row(const StageRows& st, const __nv_bfloat16* acts, unsigned long long* ll,
                                          int s, int r, float sum, bool lowlat) {
  const __nv_bfloat16 y = __float2bfloat16(sum);
  st.y[r] = y;
  if (lowlat) st_ll(ll + (st.y - acts) + r, static_cast<unsigned>(s + 1), __bfloat16_as_ushort(y));
}

__global__ void __launch_bounds__(kThreads, 1)
    chain_kernel(const __nv_bfloat16* __restrict__ w, __nv_bfloat16* acts, const long long* __restrict__ meta,
                 int S, unsigned* counter, int* gave_up, long long max_spin, int ring_units, int depth,
                 int mode, unsigned long long* ll) {
  extern __shared__ uint4 ring[];  // [ring_units] 16-byte units
  __shared__ uint4 xs[kMaxK / 8];  // kLL: the stage's input, gathered from its LL pairs
  __shared__ alignas(8) unsigned long long bars[64];  // kTma: stage s's mbarrier is bars[s & 63]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x, G = gridDim.x;
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t bar_base = static_cast<uint32_t>(__cvta_generic_to_shared(bars));
  const bool tma = mode & kTma, lowlat = mode & kLL;
  if (tma) {
    if (tid == 0) {
      for (int i = 0; i < 64; ++i) mbar_init(bar_base + 8 * i, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }

  long long issued_units = 0, freed_units = 0;  // since the launch, in 16-byte units
  int next = 0;                                 // the first stage not yet issued
  __shared__ long long stage_start[64];  // ring position (units since the launch) of each stage in flight
  for (int s = 0; s < S; ++s) {
    // (1) copy in the stages that fit, in order
    while (next < S && next <= s + depth) {
      const StageRows st = stage_rows(meta, w, acts, next, b, G);
      const int units = st.rows * st.K / 8;
      if (issued_units + units - freed_units > ring_units) break;
      const uint4* src = reinterpret_cast<const uint4*>(st.w);
      const int base = static_cast<int>(issued_units % ring_units);
      if (tma) {
        if (tid == 32) {
          // the ring's units were last read by this block's threads (generic proxy) before the copies write them
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          const uint32_t bar = bar_base + 8 * (next & 63);
          mbar_expect(bar, static_cast<unsigned>(units) * 16u);
          for (int u = 0; u < units;) {  // pieces of at most kBulkBytes, split at the ring's end
            const int slot = base + u < ring_units ? base + u : base + u - ring_units;
            const int n = min(min(units - u, ring_units - slot), static_cast<int>(kBulkBytes / 16));
            bulk_copy(ring_base + slot * 16u, src + u, static_cast<unsigned>(n) * 16u, bar);
            u += n;
          }
        }
      } else {
        // with kCopyApart warp 0 (the barrier's thread) issues no copies: a fence waits for its own in flight
        const int first = mode & kCopyApart ? 32 : 0, step = mode & kCopyApart ? kThreads - 32 : kThreads;
        for (int u = tid - first; u >= 0 && u < units; u += step) {
          const int slot = base + u < ring_units ? base + u : base + u - ring_units;  // units <= ring_units
          cp_async16(ring_base + slot * 16u, src + u);
        }
        cp_async_commit();
      }
      if (tid == 0) stage_start[next & 63] = issued_units;  // read after (4)'s __syncthreads; depth < 64
      issued_units += units;
      ++next;
    }
    const StageRows st = stage_rows(meta, w, acts, s, b, G);
    // (2) the grid barrier behind stage s - 1
    if (s > 0 && !(mode & kNoBarrier) && !lowlat) {
      if (tid == 0) {
        wait_counter(counter, static_cast<unsigned>(s) * G, max_spin, gave_up);
        __threadfence();
      }
      __syncthreads();
    }
    // (3) the input, from L2 (written by other blocks this launch: never in this SM's L1)
    const int KU = st.K / 8;
    float x[kMaxUnitsPerLane][8];
    if (lowlat) {
      gather_ll_input(reinterpret_cast<unsigned*>(xs), st, acts, ll, s, tid, kThreads, !(mode & kNoBarrier),
                      max_spin, gave_up);
      __syncthreads();
      input_from_units<false>(x, xs, lane, KU);
    } else {
      input_from_units<true>(x, reinterpret_cast<const uint4*>(st.x), lane, KU);
    }
    // (4) this stage's weights in shared memory
    if (tma) {
      mbar_wait(bar_base + 8 * (s & 63), static_cast<unsigned>(s >> 6) & 1u);
    } else {
      cp_async_wait_pending(next - s - 1);
    }
    __syncthreads();
    // (5) a warp a row
    const int start = static_cast<int>(stage_start[s & 63] % ring_units);
    for (int r = warp; r < st.rows; r += kWarps) {
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < kMaxUnitsPerLane; ++i) {
        const int u = lane + 32 * i;
        if (u < KU) {
          int slot = start + r * KU + u;  // r * KU + u < the stage's units <= ring_units: one wrap at most
          if (slot >= ring_units) slot -= ring_units;
          acc = dot_unit(acc, ring[slot], x[i]);
        }
      }
      acc = warp_sum(acc);
      if (lane == 0) store_row(st, acts, ll, s, r, acc, lowlat);
    }
    // (6) the ring's units of stage s are free; arrive
    __syncthreads();
    freed_units += st.rows * KU;
    if (s + 1 < S && tid == 0 && !lowlat) {
      if (mode & kRelease) {
        red_release_add(counter, 1u);
      } else {
        __threadfence();
        atomicAdd(counter, 1u);
      }
    }
  }
}

// kPipe: the weight stream never waits for the chain. Warp 0 is a producer: its lane 0 walks every stage's rows in
// pages of at most page_bytes (whole rows; cuda_chain.py's PAGE_BYTES by default), each a bulk copy into the next
// slot of a ring of pages, as soon as the consumers have freed that slot (its `empty` mbarrier); warps 1-15
// consume: at each stage they wait for their input (the counter or LL pairs, as above), then for each page (its
// `full` mbarrier), sum its rows (row r of the stage by warp 1 + r % 15) and free the slot. The ring thus holds
// the pages ahead across the stages' waits, where `chain_kernel` frees a stage's rows only as a whole and holds
// about one stage ahead.
constexpr int kConsumers = kWarps - 1;

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }\n" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"r"(kConsumers * 32) : "memory");
}

__device__ __forceinline__ int page_rows(int K, int page_bytes) { return max(1, page_bytes / (2 * K)); }

// pipe's consumers wait at the counter for every block's stage s - 1 (consumer thread 0 polls, the rest at the sync)
__device__ __forceinline__ void consumers_wait_counter(const unsigned* counter, int s, int G, int ctid,
                                                       long long max_spin, int* gave_up) {
  if (ctid == 0) wait_counter(counter, static_cast<unsigned>(s) * G, max_spin, gave_up);
  consumers_sync();
}

// kMma's page: 16 lines, each a row of page_bytes / 32 columns and 16 bytes more (cuda_chain.py's MMA_PAGE_PAD:
// 256 bytes a page)
__host__ __device__ constexpr unsigned mma_line(int page_bytes) { return 2u * (page_bytes / 32) + 16u; }
__host__ __device__ constexpr unsigned mma_slot_bytes(int page_bytes) { return 16u * mma_line(page_bytes); }
// kMma: the warps a page's k-blocks are split among (mode's bits at kMmaPartsShift)
__host__ __device__ constexpr int mma_parts(int mode) { return 1 << ((mode >> kMmaPartsShift) & 3); }

__host__ __device__ constexpr int pipe_slot_bytes(int page_bytes, int mode) {
  return (mode & kMma) && !(mode & kMmaPacked) ? static_cast<int>(mma_slot_bytes(page_bytes)) : page_bytes;
}

// kMmaPacked: where 16-byte unit u of row i of a page whose rows hold `units` of them sits in its row (the
// swizzle stays inside each whole group of 8 units; a row's last units short of a group stay in place)
__host__ __device__ constexpr unsigned packed_unit(unsigned u, unsigned i, unsigned units) {
  return u < (units & ~7u) ? u ^ (i & 7u) : u;
}

// kMmaFold: the segments a tile of `rows` rows of K columns is folded into (1: not folded; see kMmaFold)
__host__ __device__ constexpr int tile_folds(int rows, int K, bool fold) {
  int f = !fold || rows >= 16 ? 1 : 16 / rows < 8 ? 16 / rows : 8;
  while (f > 1 && K % (16 * f) != 0) --f;
  return f;
}

// A block's row tile from row r0 of a stage on, with `left` of its rows from there: its `real` rows (16 but the
// block's last), as `rows` virtual rows of K columns, f segments of each real row (kMmaFold; 1: not folded)
struct Tile {
  int real, f, rows, K;
};
__host__ __device__ constexpr Tile row_tile(int left, int K, bool fold) {
  const int real = left < 16 ? left : 16, f = tile_folds(real, K, fold);
  return {real, f, f * real, K / f};
}

// kMmaPacked: where page (r0, k0) of a block's tile of `rows` rows starts, in values from the block's first row
// (a folded tile: its f r virtual rows, k0 of its K / f columns)
__host__ __device__ constexpr long long packed_page(int r0, int rows, int k0, int K) {
  return static_cast<long long>(r0) * K + static_cast<long long>(rows) * k0;
}

// kMma's pages: page g holds rows [r0, r0 + 16) x columns [k0, k0 + kc) of one stage (fewer at the block's last
// rows or the row's end), its row i at byte i * line of the slot (kMmaPacked: i * 2 kc', kc' the page's columns,
// its units swizzled). `next` steps to the next page's slot, and its use (how many times the ring has come round
// to it), without a division.
struct MmaPages {
  int kc;          // a page's columns
  unsigned line;   // bytes from a page's row to the next: 2 kc + 16 (ldmatrix's 8 rows on 32 different banks)
  unsigned bytes;  // a slot: 16 lines (kMmaPacked: page_bytes)
  bool packed;
  int parts;  // warps a page: each sums k-blocks [part x kb, (part + 1) x kb) of it
  int kb;     // a part's k-blocks, kc / 16 / parts rounded up (fewer in a row's last page)
  int pages, slot = 0, use = 0;
  __device__ MmaPages(int page_bytes, int pages_, int mode)
      : kc(page_bytes / 32),
        line(mma_line(page_bytes)),
        bytes(pipe_slot_bytes(page_bytes, mode)),
        packed(mode & kMmaPacked),
        parts(mma_parts(mode)),
        kb((kc / 16 + parts - 1) / parts),
        pages(pages_) {}
  __device__ void next() {
    if (++slot == pages) {
      slot = 0;
      ++use;
    }
  }
  __device__ void advance(int n) {  // n pages on
    slot += n;
    use += slot / pages;
    slot %= pages;
  }
};

// kMma: the first of a stage's part-pages from h on that consumer warp cw owns, the stage's first at ring position
// i0 of m (a part-page's position: its slot times the parts a page, plus its part; the owner: position % 15), or
// INT_MAX where the warp owns no position (cw >= m). O(1): a consumer steps straight to its own pages, where a walk
// over every page of the stage, with each page's setup hoisted above the owner's test by the compiler, took 86
// instructions a page in every warp (Nsight Compute, session 67: 38% of the kernel's instructions, all 15 warps
// walking at once while the owner of the stage's first page waited for an issue slot)
__host__ __device__ __forceinline__ int next_owned(int i0, int h, int m, int cw) {
  if (cw >= m) return INT_MAX;
  const int i = (i0 + h) % m, d = (cw - i % kConsumers + kConsumers) % kConsumers;
  return i + d < m ? h + d : h + (m - i) + cw;
}

// kMma: a block's pages of a stage in the producer's order: its whole 16-row tiles' (`tile` pages each), then its
// last tile's if short of 16 rows (`last`, of `short_tile`'s geometry), n in all; worked out once a stage by each
// consumer warp, for its pages and for the rows' sums
struct StagePages {
  int tile, last, n;
  int whole_rows;  // the rows of the whole tiles
  Tile short_tile;
  __host__ __device__ StagePages(int rows, int K, int kc, bool fold)
      : tile((K + kc - 1) / kc), whole_rows(rows / 16 * 16), short_tile(row_tile(rows % 16 ? rows % 16 : 16, K, fold)) {
    last = rows % 16 ? (short_tile.K + kc - 1) / kc : 0;
    n = rows / 16 * tile + last;
  }
  // the partial sums of a row r of the stage: its tile's pages times its segments
  __host__ __device__ int row_pages(int r) const { return r < whole_rows ? tile : last * short_tile.f; }
};

// kMma: a consumer warp's way through its own part-pages of a stage, in the producer's order (next_owned): part-page
// h is part p of the stage's page `page`, in slot `slot` at its use-th time round the ring, rows [r0, r0 + 16) x
// column page c of the block's tile there. Made before the stage's input is in, so that the way to the warp's first
// page (a stage's setup: 186 instructions a warp with five 32-bit divisions, Nsight Compute, session 68) is off the
// stage's critical path; `next` goes on to the warp's next page with no division but the tile's and the ring's
// position. Done when h passes the stage's part-pages.
struct PageWalk {
  int at, slot, use;  // the stage's page `at`: its slot and use
  int h, page, p, r0, c;
  int i0, m, end, cw, parts, pages, tile;
  __host__ __device__ PageWalk(const StagePages& sp, int slot0, int use0, int pages_, int parts_, int cw_)
      : at(0),
        slot(slot0),
        use(use0),
        i0(slot0 * parts_),
        m(pages_ * parts_),
        end(sp.n * parts_),
        cw(cw_),
        parts(parts_),
        pages(pages_),
        tile(sp.tile) {
    to(next_owned(i0, 0, m, cw));
  }
  __host__ __device__ bool done() const { return h >= end; }
  __host__ __device__ void next() { to(next_owned(i0, h + 1, m, cw)); }
  __host__ __device__ void to(int h_) {
    h = h_;
    if (done()) return;
    page = parts == 1 ? h : h / parts;
    p = h - page * parts;
    for (slot += page - at, at = page; slot >= pages; slot -= pages) ++use;
    const int tile_index = page / tile;
    r0 = 16 * tile_index;
    c = page - tile_index * tile;
  }
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
}

// d += A (16 x 16 bf16, a's fragment) times B (16 x 8 bf16, b0 b1's fragment), in fp32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// kMmaPipelined: the A fragments (ldmatrix) of k-blocks j and j + 1 of a packed page whose units are all swizzled
// (sw: the lane's row & 7); then their two mmas into two sums, B (the input's 8 bytes a lane: xb[0], xb[4]) read
// beside them
__device__ __forceinline__ void mma_load2(uint32_t (&a)[2][4], uint32_t a_addr, int j, unsigned half, uint32_t sw) {
  ldmatrix_x4(a[0], a_addr + 16u * ((2u * j + half) ^ sw));
  ldmatrix_x4(a[1], a_addr + 16u * ((2u * (j + 1) + half) ^ sw));
}

__device__ __forceinline__ void mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[2][4], const uint2* xb) {
  const uint2 b0 = xb[0], b1 = xb[4];
  mma_bf16(c0, a[0], b0.x, b0.y);
  mma_bf16(c1, a[1], b1.x, b1.y);
}

// kMma's trace (when `trace` is not null): block b's row of stage s ([blocks][S][kTraceWidth] 64-bit values) takes
// the SM clock at point k in [k] (cuda_chain_trace.py's TRACE_POINTS): 0 the consumers start the stage, 1 its
// input is in, 2 its pages are summed, 3 consumer 0 has stored its row; the producer 4 has the stage's first
// page's slot (and in-flight room), 5 has issued its last page; 6 and 7 the stage's first and last page are in
// (their warp through its wait), 8 and 9 those pages summed (their warp's partial sums written), 10 consumer 0's
// share of the input in (before the consumers' sync). The producer's two points also take the ns timer, in
// [16 + k], after the clock: the timer lines the SMs' clocks up, and its read is an instruction of variable latency
// that the warp waits out before storing it: read at a consumer's point, it would count inside that consumer's
// next span (session 65's first traces), so the consumers' points take the clock alone.
constexpr int kTraceWidth = 32;
__device__ __forceinline__ void trace_point(unsigned long long* trace, int b, int S, int s, int k,
                                            bool timer = false) {
  if (trace == nullptr) return;
  unsigned long long* row = trace + (static_cast<long long>(b) * S + s) * kTraceWidth;
  row[k] = clock64();
  if (timer) {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns));
    row[16 + k] = ns;
  }
}

// kMma's producer: every stage's pages in order, row tiles outer, each row of a page a bulk copy into its line
// (kMmaPacked: the page one copy, its rows contiguous in the packed weights); with kNoStream each page completed
// without a copy. Lane 0 alone runs it, or with kMmaLanes the whole warp: lane 0 waits for the slot and sets its
// byte count, then lane i copies row i. With 0 < inflight < pages, page g is issued only once page g - inflight
// has landed: at most `inflight` pages' copies in flight (the ring may hold more pages landed and not yet summed),
// so that a stage's input, read from L2 by the same SM, queues behind fewer bytes.
__device__ void mma_produce(const long long* meta, const int2* block_rows, const __nv_bfloat16* w,
                            __nv_bfloat16* acts, int S, int b, uint32_t ring_base, uint32_t full_base,
                            uint32_t empty_base, int pages, int page_bytes, int mode, int lane, int inflight,
                            unsigned long long* trace) {
  const bool lanes = mode & kMmaLanes;
  const bool capped = inflight > 0 && inflight < pages, spin = mode & kTestWait, fold = mode & kMmaFold;
  MmaPages pg(page_bytes, pages, mode);
  for (int s = 0; s < S; ++s) {
    const StageRows st = stage_rows(meta, block_rows, w, acts, s);
    bool first = true;
    for (int r0 = 0; r0 < st.rows; r0 += 16) {
      const Tile tile = row_tile(st.rows - r0, st.K, fold);
      const int rows = tile.rows, K = tile.K;  // the tile's (virtual) rows and columns
      for (int k0 = 0; k0 < K; k0 += pg.kc, pg.next()) {
        const uint32_t full = full_base + 8 * pg.slot;
        if (lane == 0 && pg.use > 0) mbar_wait(empty_base + 8 * pg.slot, static_cast<unsigned>(pg.use - 1) & 1u, spin);
        if (capped && lane == 0) {  // page g - inflight: its slot and use
          const bool wrapped = pg.slot < inflight;
          const int use = pg.use - wrapped;
          if (use >= 0)
            mbar_wait(full_base + 8 * (pg.slot - inflight + (wrapped ? pages : 0)), static_cast<unsigned>(use) & 1u,
                      spin);
        }
        if (first && lane == 0) trace_point(trace, b, S, s, 4, true);  // the stage's first page free to issue
        first = false;
        if (mode & kNoStream) {
          if (lane == 0) mbar_arrive(full);
          continue;
        }
        const unsigned row_bytes = 2u * static_cast<unsigned>(min(pg.kc, K - k0));
        if (pg.packed) {  // lane 0 alone: page (r0, k0) of the block's rows at r0 K + rows k0 of them
          mbar_expect(full, row_bytes * rows);
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          bulk_copy(ring_base + pg.slot * pg.bytes, st.w + packed_page(r0, rows, k0, st.K), row_bytes * rows, full);
          continue;
        }
        if (lane == 0) mbar_expect(full, row_bytes * rows);
        if (lanes) __syncwarp();  // the slot free and its bytes expected before any lane's copy
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const uint32_t dst = ring_base + pg.slot * pg.bytes;
        for (int i = lanes ? lane : 0; i < rows; i += lanes ? 32 : 1) {
          bulk_copy(dst + i * pg.line, st.w + static_cast<long long>(r0 + i) * st.K + k0, row_bytes, full);
        }
      }
    }
    if (lane == 0) trace_point(trace, b, S, s, 5, true);
  }
}

// kMma's consumers at stage s (the input in xs in fragment order): warp cw (the walk's) sums its parts of pages
// (part p of a page in slot i is warp (i parts + p) % 15's) with one mma a k-block, four chains of them, each row's
// partial sum going to sums[(c parts + p) * rows + row] for part p of the page of columns c * kc on (a folded
// tile's virtual row v = j r + i: sums[((c f + j) parts + p) * rows + r0 + i]).
__device__ void mma_consume(const StageRows& st, const StagePages& sp, const MmaPages& pg, PageWalk& walk,
                            const unsigned* xs, float* sums, uint32_t ring_base, uint32_t full_base,
                            uint32_t empty_base, int lane, bool compute, bool spin, bool pipelined,
                            unsigned long long* trace, int b, int S, int s) {
  // ldmatrix.x4: lanes 0-7 give rows 0-7 of the k-block's columns 0-7, lanes 8-15 rows 8-15, lanes 16-31 the
  // same at columns 8-15: a0..a3 of mma's A fragment
  const unsigned row = (lane & 7) + (lane & 8), half = lane >> 4;
  const uint32_t lane_off = row * pg.line + (half << 4);
  const int t = lane & 3, gi = lane >> 2;
  const int kb = pg.kb, n = sp.n;
  // a slot's part p of every page goes to one warp: a parity wait can only tell the phase it asks for from the one
  // before it, so a warp that skipped the slot's last use (page g - pages, another warp's) could find that use's
  // phase still open and take it for the one before: through at once, summing a page not yet there
  for (; !walk.done(); walk.next()) {
    const int page = walk.page, p = walk.p, slot = walk.slot, use = walk.use, r0 = walk.r0, c = walk.c;
    const int k0 = c * pg.kc;
    const bool whole = r0 < sp.whole_rows;
    const Tile tile = whole ? Tile{16, 1, 16, st.K} : sp.short_tile;
    const int real = tile.real, f = tile.f, rows = tile.rows, K = tile.K;  // (virtual) rows and columns: kMmaFold
    mbar_wait(full_base + 8 * slot, static_cast<unsigned>(use) & 1u, spin);
    // the stage's first and last page (trace points 6-9): part 0's warp, lane 0
    const bool traced = trace != nullptr && lane == 0 && p == 0;
    const bool first_page = page == 0, last_page = page == n - 1;
    if (traced && first_page) trace_point(trace, b, S, s, 6);
    if (traced && last_page) trace_point(trace, b, S, s, 7);
    __syncwarp();  // every lane through the wait before the warp-wide ldmatrix and mma
    if (compute) {
      const int kcp = min(pg.kc, K - k0);  // the page's columns
      const uint32_t slot_addr = ring_base + slot * pg.bytes;
      // k-block j's 8 x 8 matrix for this lane: 16-byte unit 2 j + half of its row
      const uint32_t a_addr = pg.packed ? slot_addr + row * 2u * kcp : slot_addr + lane_off;
      const unsigned units = kcp / 8;
      // k-block j's B: xb[4 j], column gi of it segment gi's input (segment 0 past the tile's f: unused)
      const uint2* xb = reinterpret_cast<const uint2*>(xs + ((gi < f ? gi * K : 0) + k0) / 2) + t;
      const int kblocks = min(kcp / 16, (p + 1) * kb);  // this part's k-blocks: [p kb, kblocks)
      float acc[4][4] = {};
      const bool piped = pipelined && pg.packed && pg.parts == 1 && kcp % 64 == 0;
      if (piped) {
        // kMmaPipelined: whole groups of 4 k-blocks (the loop's step), every unit swizzled, with no branch
        // between the loads and the mmas, and the next two k-blocks' loads issued before this two's mmas (four
        // sums in turn)
        const uint32_t sw = row & 7u;
        uint32_t a0[2][4], a1[2][4];
        mma_load2(a0, a_addr, 0, half, sw);
        for (int j = 0; j < kcp / 16; j += 4) {
          mma_load2(a1, a_addr, j + 2, half, sw);
          mma2(acc[0], acc[1], a0, xb + 4 * j);
          if (j + 4 < kcp / 16) mma_load2(a0, a_addr, j + 4, half, sw);
          mma2(acc[2], acc[3], a1, xb + 4 * (j + 2));
        }
      }
      for (int j = p * kb; j < kblocks && !piped; j += 4) {
        // four k-blocks' loads before their mmas: volatile asm keeps its order, so an mma between two ldmatrix
        // waited out each one's latency (32 of them a 16 KB page, one after the other)
        uint32_t a[4][4];
        uint2 bx[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (j + q < kblocks) {
            const unsigned u = 2u * (j + q);
            ldmatrix_x4(a[q], pg.packed ? a_addr + 16u * packed_unit(u + half, row, units) : a_addr + 16u * u);
            bx[q] = xb[4 * (j + q)];
          }
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          if (j + q < kblocks) mma_bf16(acc[q], a[q], bx[q].x, bx[q].y);
        }
      }
      // virtual row v's sum is column v / real of C (unfolded: column 0; B's 8 columns are all the input),
      // held by lane t = that column / 2 of the lanes that hold row v: C[gi][2t, 2t + 1], C[gi + 8][2t, 2t + 1].
      // Its partial sum goes to real row r0 + v % real, column page c f + v / real.
      // (the element chosen by selects: acc indexed at run time would go to local memory)
      float y[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) y[e] = (acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e]);
      float* const part = sums + r0;
      if (f == 1) {  // not folded: column 0 of C, rows gi and gi + 8 in lanes t == 0
        if (t == 0 && gi < rows) part[(c * pg.parts + p) * st.rows + gi] = y[0];
        if (t == 0 && gi + 8 < rows) part[(c * pg.parts + p) * st.rows + gi + 8] = y[2];
      } else {  // C's rows gi and gi + 8 (virtual rows): their segment, the column of C that holds their sum
        const int j0 = gi / real, j1 = (gi + 8) / real;
        if (gi < rows && j0 / 2 == t) part[((c * f + j0) * pg.parts + p) * st.rows + gi % real] = j0 & 1 ? y[1] : y[0];
        if (gi + 8 < rows && j1 / 2 == t)
          part[((c * f + j1) * pg.parts + p) * st.rows + (gi + 8) % real] = j1 & 1 ? y[3] : y[2];
      }
    }
    __syncwarp();
    if (traced && first_page) trace_point(trace, b, S, s, 8);
    if (traced && last_page) trace_point(trace, b, S, s, 9);
    if (lane == 0) mbar_arrive(empty_base + 8 * slot);
  }
}

// Compiled twice, with and without kMma (kMmaPath, mode's kMma bit): each registers' allocation its own, so that
// one path's registers do not spill the other's.
template <bool kMmaPath>
__global__ void __launch_bounds__(kThreads, 1)
    chain_pipe_kernel(const __nv_bfloat16* __restrict__ w, __nv_bfloat16* acts, const long long* __restrict__ gmeta,
                      int S, unsigned* counter, int* gave_up, long long max_spin, int pages, int mode,
                      unsigned long long* ll, int page_bytes, int inflight, unsigned long long* trace) {
  extern __shared__ uint4 ring[];  // [pages][page_bytes / 16]
  __shared__ uint4 xs[kMaxK / 8];
  __shared__ alignas(8) unsigned long long full[64], empty[64];
  // every stage's entries, read once here: a stage's read of them from global memory put an L2 round trip before
  // its input's address (call C: the consumers' work alone 10.9 us a layer with no barrier)
  __shared__ long long meta[kMaxStages * kMeta];
  __shared__ float sums[kMaxPartials];  // kMma: the stage's pages' partial sums, [column page][row]
  __shared__ int2 block_rows[kMaxStages];  // this block's first row of each stage and the next block's
  for (int i = threadIdx.x; i < S * kMeta; i += kThreads) meta[i] = gmeta[i];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.x, G = gridDim.x;
  for (int i = tid; i < S; i += kThreads) block_rows[i] = block_row_span(gmeta[i * kMeta + 4], b, G);
  const uint32_t ring_base = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t full_base = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint32_t empty_base = static_cast<uint32_t>(__cvta_generic_to_shared(empty));
  const bool lowlat = mode & kLL;
  if (tid == 0) {
    for (int i = 0; i < pages; ++i) {
      mbar_init(full_base + 8 * i, 1);
      mbar_init(empty_base + 8 * i, kMmaPath ? mma_parts(mode) : mode & kOwnPages ? 1 : kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (kMmaPath && warp == 0) {
    if (lane == 0 || (mode & kMmaLanes))
      mma_produce(meta, block_rows, w, acts, S, b, ring_base, full_base, empty_base, pages, page_bytes, mode, lane,
                  inflight, trace);
    return;
  }
  if (warp == 0) {  // the producer: lane 0, or with kProducers4 lanes 0-3 taking every fourth page
    const int producers = mode & kProducers4 ? 4 : 1;
    if (lane < producers) {
      long long g = 0;  // pages issued since the launch
      for (int s = 0; s < S; ++s) {
        const StageRows st = stage_rows(meta, block_rows, w, acts, s);
        const int rpp = page_rows(st.K, page_bytes);
        for (int r = 0; r < st.rows; r += rpp, ++g) {
          if (g % producers != lane) continue;
          const int slot = static_cast<int>(g % pages);
          const long long use = g / pages;
          if (use > 0) mbar_wait(empty_base + 8 * slot, static_cast<unsigned>(use - 1) & 1u);
          if (mode & kNoStream) {
            mbar_arrive(full_base + 8 * slot);
            continue;
          }
          asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
          const unsigned bytes = static_cast<unsigned>(min(rpp, st.rows - r) * st.K * 2);
          mbar_expect(full_base + 8 * slot, bytes);
          bulk_copy(ring_base + slot * page_bytes, st.w + static_cast<long long>(r) * st.K, bytes,
                    full_base + 8 * slot);
        }
      }
    }
    return;
  }
  const int cw = warp - 1, ctid = tid - 32;
  if (kMmaPath) {
    MmaPages pg(page_bytes, pages, mode);
    unsigned* xw = reinterpret_cast<unsigned*>(xs);
    unsigned long long* const tr = ctid == 0 ? trace : nullptr;
    for (int s = 0; s < S; ++s) {
      const StageRows st = stage_rows(meta, block_rows, w, acts, s);
      trace_point(tr, b, S, s, 0);
      // the stage's pages and this warp's way to its first, while the input is on its way (see PageWalk)
      const StagePages sp(st.rows, st.K, pg.kc, mode & kMmaFold);
      PageWalk walk(sp, pg.slot, pg.use, pg.pages, pg.parts, cw);
      pg.advance(sp.n);  // the ring's position at the next stage (a division: here, not after the stage's sums)
      if (mode & (kNoInput | kNoCompute)) {
        for (int i = ctid; i < st.K / 2; i += kConsumers * 32) xw[i] = 0u;
      } else if (lowlat) {
        gather_ll_input<kGatherBatch>(xw, st, acts, ll, s, ctid, kConsumers * 32, !(mode & kNoBarrier), max_spin,
                                      gave_up, true, mode & kPollSleep ? kPollSleepNs : 0u);
      } else {
        if (s > 0 && !(mode & kNoBarrier)) consumers_wait_counter(counter, s, G, ctid, max_spin, gave_up);
        const unsigned* src = reinterpret_cast<const unsigned*>(st.x);
        for (int i0 = ctid; i0 < st.K / 2; i0 += kConsumers * 32 * kGatherBatch) {  // the loads first (see gather)
          unsigned v[kGatherBatch];
#pragma unroll
          for (int q = 0; q < kGatherBatch; ++q) {
            const int i = i0 + kConsumers * 32 * q;
            if (i < st.K / 2) v[q] = __ldcg(src + i);
          }
#pragma unroll
          for (int q = 0; q < kGatherBatch; ++q) {
            const int i = i0 + kConsumers * 32 * q;
            if (i < st.K / 2) xw[frag_word(i, true)] = v[q];
          }
        }
      }
      trace_point(tr, b, S, s, 10);
      consumers_sync();  // the input in xs (and the last stage's partial sums read)
      trace_point(tr, b, S, s, 1);
      mma_consume(st, sp, pg, walk, xw, sums, ring_base, full_base, empty_base, lane, !(mode & kNoCompute),
                  mode & kTestWait, mode & kMmaPipelined, trace, b, S, s);
      consumers_sync();  // every page's partial sums in
      trace_point(tr, b, S, s, 2);
      for (int r = ctid; r < st.rows; r += kConsumers * 32) {
        // its tile's pages a row (a folded tile's: its pages times its segments), each in pg.parts parts
        const int column_pages = sp.row_pages(r) * pg.parts;
        float sum = 0.f;
        for (int c = 0; c < column_pages; ++c) sum += sums[c * st.rows + r];
        store_row(st, acts, ll, s, r, sum, lowlat);
      }
      trace_point(tr, b, S, s, 3);
      if (lowlat && (mode & kStoreFirst)) consumers_sync();  // every output of the stage issued before any poll
      if (!lowlat && s + 1 < S) {
        consumers_sync();  // every output of the stage stored
        if (ctid == 0) red_release_add(counter, 1u);
      }
    }
    return;
  }
  long long g = 0;  // pages consumed since the launch
  for (int s = 0; s < S; ++s) {
    const StageRows st = stage_rows(meta, block_rows, w, acts, s);
    const int KU = st.K / 8;
    float x[kMaxUnitsPerLane][8];
    const bool compute = !(mode & kNoCompute);
    if (!compute || (mode & kNoInput)) {
      // kNoCompute: the pages waited for and freed, nothing read (the stream alone); kNoInput: no input read
#pragma unroll
      for (int i = 0; i < kMaxUnitsPerLane; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[i][j] = 0.f;
      }
    } else if (lowlat) {
      gather_ll_input(reinterpret_cast<unsigned*>(xs), st, acts, ll, s, ctid, kConsumers * 32,
                      !(mode & kNoBarrier), max_spin, gave_up);
      consumers_sync();
      input_from_units<false>(x, xs, lane, KU);
    } else {
      if (s > 0 && !(mode & kNoBarrier)) consumers_wait_counter(counter, s, G, ctid, max_spin, gave_up);
      input_from_units<true>(x, reinterpret_cast<const uint4*>(st.x), lane, KU);
    }
    const int rpp = page_rows(st.K, page_bytes);
    if (mode & kOwnPages) {
      for (int r0 = 0; r0 < st.rows; r0 += rpp, ++g) {
        const int slot = static_cast<int>(g % pages);
        if (slot % kConsumers != cw) continue;  // a slot's owner: see mma_consume
        mbar_wait(full_base + 8 * slot, static_cast<unsigned>(g / pages) & 1u);
        const uint4* page = ring + slot * (page_bytes / 16);
        const int r1 = min(r0 + rpp, st.rows);
        for (int rb = r0; compute && rb < r1; rb += 4) {
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int i = 0; i < kMaxUnitsPerLane; ++i) {
            const int u = lane + 32 * i;
            if (u < KU) {
#pragma unroll
              for (int q = 0; q < 4; ++q) {
                if (rb + q < r1) acc[q] = dot_unit(acc[q], page[(rb + q - r0) * KU + u], x[i]);
              }
            }
          }
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[q] = warp_sum(acc[q]);
          if (lane == 0) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              if (rb + q < r1) store_row(st, acts, ll, s, rb + q, acc[q], lowlat);
            }
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(empty_base + 8 * slot);
      }
      consumers_sync();  // every output of the stage stored (and xs read)
      if (!lowlat && s + 1 < S && ctid == 0) red_release_add(counter, 1u);
      continue;
    }
    for (int r0 = 0; r0 < st.rows; r0 += rpp, ++g) {
      const int slot = static_cast<int>(g % pages);
      // every lane polls (lane 0 alone and a __syncwarp: the stream alone 10.0 us a layer against 8.5, call v)
      mbar_wait(full_base + 8 * slot, static_cast<unsigned>(g / pages) & 1u);
      const uint4* page = ring + slot * (page_bytes / 16);
      for (int r = r0; r < min(r0 + rpp, st.rows); ++r) {
        if (r % kConsumers != cw || !compute) continue;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};  // four chains of fmas, not one
#pragma unroll
        for (int i = 0; i < kMaxUnitsPerLane; ++i) {
          const int u = lane + 32 * i;
          if (u < KU) {
            const uint4 v = page[(r - r0) * KU + u];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(h[j]);
              acc[j] = fmaf(f.x, x[i][2 * j], acc[j]);
              acc[j] = fmaf(f.y, x[i][2 * j + 1], acc[j]);
            }
          }
        }
        const float sum = warp_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
        if (lane == 0) store_row(st, acts, ll, s, r, sum, lowlat);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty_base + 8 * slot);
    }
    consumers_sync();  // every output of the stage stored (and xs read)
    if (!lowlat && s + 1 < S && ctid == 0) red_release_add(counter, 1u);
  }
}

}  // namespace

extern "C" int kestrel_chain_setup(int smem_bytes) {
  const void* kernels[] = {reinterpret_cast<const void*>(chain_kernel),
                           reinterpret_cast<const void*>(chain_pipe_kernel<true>),
                           reinterpret_cast<const void*>(chain_pipe_kernel<false>)};
  for (const void* kernel : kernels) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return static_cast<int>(cudaSuccess);
}


extern "C" int kestrel_chain_launch(const void* w, void* acts, const void* meta, int S, void* counter,
                                    void* gave_up, long long max_spin, int blocks, int smem_bytes, int depth,
                                    int mode, void* ll, long long ll_bytes, int page_bytes, void* trace,
                                    void* stream) {
  // the Python side checks these; the launch refuses them too rather than index past its tables
  const int slot_bytes = pipe_slot_bytes(page_bytes, mode);
  const bool pipe_bad = (mode & kPipe) && (S > kMaxStages || page_bytes <= 0 || smem_bytes < slot_bytes);
  // a packed page is one copy by lane 0: with kMmaLanes every lane would set its bytes and copy it
  const bool packed_bad = ((mode & kMmaPacked) && (!(mode & kMma) || (mode & kMmaLanes))) ||
                          ((mode & kMmaFold) && (!(mode & kMmaPacked) || mma_parts(mode) > 1));
  if (S < 0 || blocks <= 0 || pipe_bad || packed_bad) return static_cast<int>(cudaErrorInvalidValue);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(counter, 0, sizeof(unsigned), st);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (mode & kLL) {
    err = cudaMemsetAsync(ll, 0, ll_bytes, st);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  if (mode & kPipe) {
    auto kernel = mode & kMma ? chain_pipe_kernel<true> : chain_pipe_kernel<false>;
    kernel<<<blocks, kThreads, smem_bytes, st>>>(
        static_cast<const __nv_bfloat16*>(w), static_cast<__nv_bfloat16*>(acts),
        static_cast<const long long*>(meta), S, static_cast<unsigned*>(counter), static_cast<int*>(gave_up),
        max_spin, min(smem_bytes / slot_bytes, 64), mode, static_cast<unsigned long long*>(ll), page_bytes, depth,
        static_cast<unsigned long long*>(trace));
    return static_cast<int>(cudaGetLastError());
  }
  chain_kernel<<<blocks, kThreads, smem_bytes, st>>>(
      static_cast<const __nv_bfloat16*>(w), static_cast<__nv_bfloat16*>(acts), static_cast<const long long*>(meta),
      S, static_cast<unsigned*>(counter), static_cast<int*>(gave_up), max_spin, smem_bytes / 16, depth, mode,
      static_cast<unsigned long long*>(ll));
  return static_cast<int>(cudaGetLastError());
}

// The weights [N, K] (bf16 bits) as chain_pipe_kernel reads them from a packed stage (cuda_chain.py's
// pack_mma_pages) over G blocks in pages of kc columns: the producer's page offsets, the consumer's swizzle. On the
// host, for the CPU tests: the packing checked against the kernel's own arithmetic.
extern "C" void kestrel_chain_unpack(const unsigned short* packed, unsigned short* w, int N, int K, int G, int kc,
                                     int fold) {
  for (int b = 0; b < G; ++b) {
    const int first = block_first_row(N, b, G), n = block_first_row(N, b + 1, G) - first;
    const unsigned short* block = packed + static_cast<long long>(first) * K;
    for (int r0 = 0; r0 < n; r0 += 16) {
      const Tile tile = row_tile(n - r0, K, fold != 0);
      // virtual row v: row r0 + v % real, its columns from (v / real) Kf on
      const int real = tile.real, rows = tile.rows, Kf = tile.K;
      for (int k0 = 0; k0 < Kf; k0 += kc) {
        const int kcp = Kf - k0 < kc ? Kf - k0 : kc;
        const unsigned short* page = block + packed_page(r0, rows, k0, K);
        for (int v = 0; v < rows; ++v)
          for (int u = 0; u < kcp / 8; ++u)
            for (int e = 0; e < 8; ++e)
              w[static_cast<long long>(first + r0 + v % real) * K + v / real * Kf + k0 + 8 * u + e] =
                  page[v * kcp + 8 * packed_unit(u, v, kcp / 8) + e];
      }
    }
  }
}

// The part-pages that consumer warp cw sums of a block's stage of `rows` rows and K columns in pages of kc columns
// (`parts` parts each; fold: kMmaFold), the stage's first page in slot `slot` of a ring of `pages` at its use-th
// time round: mma_consume's steps (next_owned, PageWalk), for the CPU tests. Each in order as 6 ints in out (h,
// slot, use, r0, c, part), at most `cap` of them; returns how many.
extern "C" int kestrel_chain_owned(int rows, int K, int kc, int fold, int slot, int use, int pages, int parts,
                                   int cw, int* out, int cap) {
  const StagePages sp(rows, K, kc, fold != 0);
  int count = 0;
  for (PageWalk walk(sp, slot, use, pages, parts, cw); !walk.done(); walk.next()) {
    if (count < cap) {
      int* const row = out + 6 * count;
      row[0] = walk.h, row[1] = walk.slot, row[2] = walk.use, row[3] = walk.r0, row[4] = walk.c, row[5] = walk.p;
    }
    ++count;
  }
  return count;
}

extern "C" const char* kestrel_chain_error(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
