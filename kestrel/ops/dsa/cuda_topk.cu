// Exact row-wise top-k for DSA in CUDA: one thread block per row (or two, variant 9), everything in shared memory
// (or, variants 5-8, a short row in registers).
// `kestrel_topk_launch` selects what `triton_topk.topk_triton` selects (the contract is in cuda_topk.py), listed
// in ascending position order, then -1. No torch headers: nvcc builds this in a few seconds.
//
// Legend: n = min(max(lens[b], 0), L) valid-prefix length of the row, k = index_topk, T = the k-th largest key,
// C = the candidates kept in shared memory (at most `cap`).
//
// The order (as triton_topk's `_sort_key`): -0.0 becomes +0.0, then the float bits map to a uint32 key whose
// unsigned order is the float order; a NaN or a position >= n gets key 0, below every valid key (a valid -inf
// is 0x007FFFFF, in 11-bit digit 3). (key desc, position asc) is a strict total order and the selection is
// its first min(k, valid) elements.
//
// Stages of one row in `topk_rows_kernel` (NT = 1024 threads; 256 or 512 in variants 3 and 4):
// 1. `histogram` over the row: the top 11 key bits of the valid keys, 2048 shared bins (shared atomics).
//    `find_threshold` gives the digit of T and the keys above it; with <= k valid keys every one is taken
//    (T = 0, need = 0) and step 4 reads the row straight away.
// 2. `gather`: when the keys whose top 11 bits are >= T's fit in `cap`, one ordered pass over the row copies
//    their (key, position) to shared memory in position order (a block scan per chunk gives the offsets).
// 3. Two more digits of T (the next 11 bits, then the last 10) from shared histograms over the candidates,
//    giving T and `need`, how many keys equal to T are taken (the lowest positions: the tie rule).
// 4. `select`: one ordered pass over the candidates writes every key > T and the first `need` keys == T to
//    the output at their rank among the taken ones, which is position order.
// Fallback when the threshold digit holds more than `cap` keys (heavy ties, an all-equal row): step 3's next
// digit is taken from the row instead (one more read of the row, from L2), and the gather retried with 22 key
// bits; when even those exceed `cap`, the last digit also comes from the row and step 4 reads the row.
// Step 4 stops at the chunk where the last selected position appears.
//
// With CL = 2 (variant 9, a cluster of two blocks a row; sm_90+) each block reads half of the row's slots and
// keeps its own candidates; every histogram is summed over both blocks through distributed shared memory, so
// both take every branch alike, and the first block's part is counted apart so that the second block's output
// ranks start after the first block's keys > T and its keys == T.
//
// Reads: every row pass loads aligned 16-byte vectors starting at the 16-byte boundary at or before the row's
// first score (at most 3 scores before it and after its end are loaded and masked: inside the allocation's
// 16-byte granule, so never past a page). Memory per row of 131072 scores, k = 2048: the row twice (the second
// mostly from L2), about 8 B per candidate to shared memory, 16 KiB of indices out.
//
// Short rows (decode's: 4096 or 8192 wide, a few hundred rows at most) take `topk_short_kernel<NT, V>`
// (variants 5-8) instead: one block a row of at most NT * V 16-byte slots, thread t holding slots t V ..
// t V + V - 1 as keys in registers. The row is read once; T comes from four 8-bit digits, each a 256-bin
// histogram of the keys in registers, with a warp's same-bin adds merged into one shared atomic (in
// topk_rows_kernel a row's first 11-bit digit puts nearly all of it into one or two bins, whose thousands of
// shared atomics to one word serialize); one block scan of the counts of keys > T and == T gives the output
// ranks. No candidate copy, no dynamic shared memory, one barrier a digit. On the H100 (session 58, L2 flushed,
// k = 2048) one row of 4096 took 9.7 us against topk_rows_kernel's 13.1-15.8, 256 rows 16.4 against 20.5-31.6;
// full rows of 8192 were no faster (cuda_topk.py's choose_variant has the sweep).
// Each short variant has a twin (WITH_ROWS, `topk_short_kernel<NT, V, true>`) that also writes every selected
// position's pool row through a page table, as triton_decode's `selected_rows` would in a launch of its own
// (cuda_topk.py's `topk_cuda_with_rows`; KESTREL_DSA_TOPK_ROWS). The twins are separate kernels so that the
// ones without rows keep their registers.

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int NB = 2048;  // bins of an 11-bit digit
constexpr int CAP_MAX = 24576;  // candidates in shared memory: 8 B each, 192 KiB
constexpr int MAX_DEVICES = 64;
constexpr int MAX_L = (1 << 30) + ((1 << 30) - (1 << 20));  // 2^31 - 2^20: int32 positions with headroom
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ uint32_t sort_key(float x, bool valid) {
    x = (x == 0.0f) ? 0.0f : x;  // -0.0 == +0.0: one key for both
    const uint32_t u = __float_as_uint(x);
    const uint32_t key = (u >> 31) ? ~u : (u | 0x80000000u);
    return (valid && x == x) ? key : 0u;
}

// Programmatic dependent launch (sm_90+; no-ops on a plain launch): let the next kernel launch at once, then wait
// for the one before this to finish before the first read of its output.
__device__ __forceinline__ void pdl_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

struct Shared {
    unsigned long long scan[32];  // per-warp totals of a block scan (at most 32 warps)
    uint32_t digit, above, at, f_above, f_at;  // find_threshold's answer
};

// A barrier over every block of the row: the block itself, or the cluster of CL blocks (whose shared-memory
// writes it also makes visible to the others).
template <int CL>
__device__ __forceinline__ void row_sync() {
    if constexpr (CL == 1) {
        __syncthreads();
    } else {
#if __CUDA_ARCH__ >= 900
        cooperative_groups::this_cluster().sync();
#else
        __trap();  // clusters need sm_90; the launcher refuses CL > 1 below that
#endif
    }
}

// Exclusive prefix sum of v over the block's NT threads in thread order; `total` gets the block's sum. Fields
// packed into v add independently as long as no field's block total overflows.
template <int NT>
__device__ __forceinline__ unsigned long long block_exclusive_scan(
    unsigned long long v, unsigned long long& total, Shared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long inc = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const unsigned long long y = __shfl_up_sync(FULL, inc, d);
        if (lane >= d) inc += y;
    }
    if (lane == 31) sh.scan[warp] = inc;
    __syncthreads();
    const unsigned long long w = lane < NT / 32 ? sh.scan[lane] : 0ull;  // one warp total per lane
    unsigned long long winc = w;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const unsigned long long y = __shfl_up_sync(FULL, winc, d);
        if (lane >= d) winc += y;
    }
    const unsigned long long before = __shfl_sync(FULL, winc - w, warp);  // sum of the earlier warps
    total = __shfl_sync(FULL, winc, 31);
    __syncthreads();  // sh.scan is free for the next scan
    return before + inc - v;
}

// A row of scores as 16-byte slots: slot s holds positions 4 s - head .. 4 s - head + 3. A block reads slots
// first .. nslots - 1 (the whole row, or its part of it when CL blocks share the row).
struct Row {
    const float4* base;  // 16-byte aligned, `head` scores before the row's first
    int head, n, first, nslots;
    using Raw = float4;

    __device__ __forceinline__ Raw fetch(int s) const {
        return s < nslots ? __ldg(base + s) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __device__ __forceinline__ void keys(int s, const Raw& v, uint32_t key[4], int pos[4]) const {
        const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            pos[j] = 4 * s + j - head;
            // slots past this block's part read as 0.0f: invalid, though their positions may be < n
            key[j] = sort_key(x[j], s < nslots && pos[j] >= 0 && pos[j] < n);
        }
    }
};

// The candidates in shared memory, 4 to a slot; entries at or past `count` read as key 0 (invalid).
struct Cands {
    const uint32_t* key;
    const int* pos;
    int count, first, nslots;
    struct Raw {
        uint4 key;
        int4 pos;
    };

    __device__ __forceinline__ Raw fetch(int s) const {
        Raw r{make_uint4(0u, 0u, 0u, 0u), make_int4(0, 0, 0, 0)};
        if (s < nslots) {
            r.key = reinterpret_cast<const uint4*>(key)[s];
            r.pos = reinterpret_cast<const int4*>(pos)[s];
        }
        return r;
    }
    __device__ __forceinline__ void keys(int s, const Raw& r, uint32_t k[4], int p[4]) const {
        const uint32_t kk[4] = {r.key.x, r.key.y, r.key.z, r.key.w};
        const int pp[4] = {r.pos.x, r.pos.y, r.pos.z, r.pos.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            k[j] = 4 * s + j < count ? kk[j] : 0u;
            p[j] = pp[j];
        }
    }
};

// A histogram of R interleaved copies: bin d's copy c is hist[d * R + c], the copy picked by the thread's lane, so
// that lanes of a warp adding to one bin (a crowded bin of the top digit) mostly hit different words.
template <int R>
__device__ __forceinline__ uint32_t bin_count(const uint32_t* hist, int d) {
    uint32_t h = 0;
#pragma unroll
    for (int c = 0; c < R; ++c) h += hist[d * R + c];
    return h;
}

// Bin (key >> shift) & (nbins - 1) += 1 for every valid key with key >> pshift == prefix (every valid key when
// ALL). Order does not matter: U slots per thread are loaded before any is used, for memory-level parallelism.
template <int NT, bool ALL, int R, class Src>
__device__ __forceinline__ void histogram(
    const Src& src, uint32_t* hist, int pshift, uint32_t prefix, int shift, uint32_t nbins) {
    constexpr int U = 4;
    for (int s0 = src.first + threadIdx.x; s0 < src.nslots; s0 += U * NT) {
        typename Src::Raw raw[U];
#pragma unroll
        for (int i = 0; i < U; ++i) raw[i] = src.fetch(s0 + i * NT);
#pragma unroll
        for (int i = 0; i < U; ++i) {
            uint32_t key[4];
            int pos[4];
            src.keys(s0 + i * NT, raw[i], key, pos);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const bool in = ALL ? key[j] != 0u : (key[j] >> pshift) == prefix;
                if (in) atomicAdd(&hist[((key[j] >> shift) & (nbins - 1)) * R + (threadIdx.x & (R - 1))], 1u);
            }
        }
    }
}

struct Threshold {
    uint32_t digit;  // the largest digit d with count(digits >= d) >= need (0 when none)
    uint32_t above;  // count(digits > d)
    uint32_t at;  // count(digit == d)
    uint32_t total;  // count(all digits)
    uint32_t f_above, f_at, f_total;  // the same counts in the first block's part of the row (CL = 2)
};

// Reads bins 0 .. nbins - 1 (nbins a multiple of NT) of the row's histogram: with CL = 2 the sum of this block's
// `hist` and the other block's `peer` (distributed shared memory), with the first block's part counted apart.
// Ends with a row_sync after its last read of either, so both may be overwritten after it.
template <int NT, int R, int CL>
__device__ __forceinline__ Threshold find_threshold(
    const uint32_t* hist, const uint32_t* peer, int nbins, uint32_t need, Shared& sh) {
    const int per = nbins / NT;
    const int hi = nbins - 1 - threadIdx.x * per;  // this thread's bins, descending: hi, hi - 1, ...
    const uint32_t* first = (CL == 1 || blockIdx.x % CL == 0) ? hist : peer;
    // count of bin d, as two 32-bit fields: the row's (low) and the first block's part (high)
    auto count = [&](int d) -> unsigned long long {
        const uint32_t f = bin_count<R>(first, d);
        const uint32_t all = CL == 1 ? f : bin_count<R>(hist, d) + bin_count<R>(peer, d);
        return (unsigned long long)all | ((unsigned long long)f << 32);
    };
    unsigned long long local = 0;
    for (int i = 0; i < per; ++i) local += count(hi - i);
    if (threadIdx.x == 0) sh.digit = sh.above = sh.at = sh.f_above = sh.f_at = 0u;
    unsigned long long total;
    unsigned long long cum = block_exclusive_scan<NT>(local, total, sh);  // keys in the bins above this thread's
    for (int i = 0; i < per; ++i) {
        const unsigned long long h = count(hi - i);
        const uint32_t c = (uint32_t)cum, hc = (uint32_t)h;
        if (c < need && c + hc >= need) {  // true for exactly one bin when total >= need
            sh.digit = hi - i;
            sh.above = c;
            sh.at = hc;
            sh.f_above = (uint32_t)(cum >> 32);
            sh.f_at = (uint32_t)(h >> 32);
        }
        cum += h;
    }
    row_sync<CL>();
    return {sh.digit, sh.above, sh.at, (uint32_t)total, sh.f_above, sh.f_at, (uint32_t)(total >> 32)};
}

// Zero the histogram, count one digit of the keys under `prefix`, find the digit of the need-th largest.
template <int NT, int R, int CL, class Src>
__device__ __forceinline__ Threshold digit_pass(const Src& src, uint32_t* hist, const uint32_t* peer, Shared& sh,
    int pshift, uint32_t prefix, int shift, int nbins, uint32_t need) {
    for (int i = threadIdx.x; i < nbins * R; i += NT) hist[i] = 0u;
    __syncthreads();
    histogram<NT, false, R>(src, hist, pshift, prefix, shift, nbins);
    row_sync<CL>();
    return find_threshold<NT, R, CL>(hist, peer, nbins, need, sh);
}

inline __device__ uint32_t field16(unsigned long long v, int i) { return (uint32_t)(v >> (16 * i)) & 0xffffu; }

// Copy the (key, position) of every key >= lo (`count` of them) to shared memory in position order. Chunks of
// 4 NT slots; a thread's 4 slot counts are 16-bit fields of one block scan (a field's total is <= 4 NT). With
// PREFETCH the next chunk's loads are issued before this chunk's scan, so their latency overlaps it.
template <int NT, bool PREFETCH>
__device__ void gather(const Row& row, uint32_t lo, uint32_t count, uint32_t* ckey, int* cpos, Shared& sh) {
    constexpr int V = 4;
    uint32_t run = 0;  // block-uniform: candidates written so far
    float4 raw[V];
    if (PREFETCH) {
#pragma unroll
        for (int i = 0; i < V; ++i) raw[i] = row.fetch(row.first + i * NT + threadIdx.x);
    }
    for (int c0 = row.first; c0 < row.nslots && run < count; c0 += V * NT) {
        if (!PREFETCH) {
#pragma unroll
            for (int i = 0; i < V; ++i) raw[i] = row.fetch(c0 + i * NT + threadIdx.x);
        }
        uint32_t key[V][4];
        int pos[V][4];
        unsigned long long packed = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            row.keys(c0 + i * NT + threadIdx.x, raw[i], key[i], pos[i]);
            uint32_t c = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) c += key[i][j] >= lo;
            packed |= (unsigned long long)c << (16 * i);
        }
        if (PREFETCH) {
#pragma unroll
            for (int i = 0; i < V; ++i) raw[i] = row.fetch(c0 + (V + i) * NT + threadIdx.x);
        }
        unsigned long long total;
        const unsigned long long excl = block_exclusive_scan<NT>(packed, total, sh);
#pragma unroll
        for (int i = 0; i < V; ++i) {  // slot i of every thread precedes slot i + 1 of every thread
            uint32_t r = run + field16(excl, i);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (key[i][j] >= lo) {
                    ckey[r] = key[i][j];
                    cpos[r] = pos[i][j];
                    ++r;
                }
            }
            run += field16(total, i);
        }
    }
}

// Write every key > T and the first `need` keys == T (in position order) of src to out at their rank among the
// taken ones, which is position order; n_sel is how many that makes, and the pass stops once all are written.
// `above` and `tie` count the keys > T and == T before src (in the first block's part of the row, for the
// second block). Chunks of 2 NT slots; per slot two 16-bit fields of one block scan: keys > T and keys == T.
template <int NT, class Src>
__device__ void select(const Src& src, uint32_t T, uint32_t need, uint32_t n_sel, uint32_t above, uint32_t tie,
    long long* out, Shared& sh) {
    constexpr int V = 2;
    uint32_t run_above = above, run_tie = tie;  // block-uniform: keys > T and == T seen so far
    for (int c0 = src.first; c0 < src.nslots && run_above + min(run_tie, need) < n_sel; c0 += V * NT) {
        typename Src::Raw raw[V];
#pragma unroll
        for (int i = 0; i < V; ++i) raw[i] = src.fetch(c0 + i * NT + threadIdx.x);
        uint32_t key[V][4];
        int pos[V][4];
        unsigned long long packed = 0;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            src.keys(c0 + i * NT + threadIdx.x, raw[i], key[i], pos[i]);
            uint32_t a = 0, t = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                a += key[i][j] > T;
                t += key[i][j] == T;
            }
            packed |= (unsigned long long)(a | t << 16) << (32 * i);
        }
        unsigned long long total;
        const unsigned long long excl = block_exclusive_scan<NT>(packed, total, sh);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            uint32_t a = run_above + field16(excl, 2 * i), t = run_tie + field16(excl, 2 * i + 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (key[i][j] > T) {
                    out[a + min(t, need)] = pos[i][j];
                    ++a;
                } else if (key[i][j] == T) {
                    if (t < need) out[a + t] = pos[i][j];
                    ++t;
                }
            }
            run_above += field16(total, 2 * i);
            run_tie += field16(total, 2 * i + 1);
        }
    }
}

// One row by CL blocks, this one its `rank` (CL = 2: a cluster, each block reading half the row's slots and
// keeping its own candidates; the histograms are summed through distributed shared memory, `peer` being the
// other block's, so both blocks take every branch alike, and the second block's output ranks start after the
// first block's keys > T and == T). NT threads a block. n valid scores from row_ptr; k selected into out_row.
template <int R, bool PREFETCH, int CL, int NT>
__device__ __forceinline__ void topk_row(const float* row_ptr, int n, int k, long long* out_row, int cap, int rank,
    uint32_t* hist, const uint32_t* peer, Shared& sh, uint32_t* ckey, int* cpos) {
    const int head = (int)((reinterpret_cast<uintptr_t>(row_ptr) >> 2) & 3);
    const int slots = n > 0 ? (n + head + 3) >> 2 : 0, part = (slots + CL - 1) / CL;
    const Row row{reinterpret_cast<const float4*>(row_ptr - head), head, n, min(rank * part, slots),
        min((rank + 1) * part, slots)};
    // select's starting counts of keys > T and == T: 0 in the first block, the first block's counts in the second
    auto before = [&](uint32_t first_part) { return rank == 0 ? 0u : first_part; };

    // Step 1: the top 11 bits.
    for (int i = threadIdx.x; i < NB * R; i += NT) hist[i] = 0u;
    __syncthreads();
    histogram<NT, true, R>(row, hist, 0, 0u, 21, NB);
    row_sync<CL>();
    const Threshold t1 = find_threshold<NT, R, CL>(hist, peer, NB, (uint32_t)k, sh);
    const uint32_t n_sel = min(t1.total, (uint32_t)k);
    if (rank == 0) {
        for (int i = n_sel + threadIdx.x; i < k; i += NT) out_row[i] = -1;
    }
    if (t1.total <= (uint32_t)k) {
        select<NT>(row, 0u, 0u, n_sel, before(t1.f_total), 0u, out_row, sh);
        return;
    }
    uint32_t need = (uint32_t)k - t1.above;  // >= 1: keys taken inside the threshold digit
    uint32_t prefix = t1.digit;  // T's top 11 bits (>= 3: only valid keys count)
    uint32_t count = t1.above + t1.at;  // keys whose top 11 bits are >= T's
    uint32_t f_count = t1.f_above + t1.f_at;  // those in the first block's part
    uint32_t f_above = t1.f_above;  // keys > T in the first block's part, so far
    int pshift = 21;  // T's bits known so far: 32 - pshift
    if (count > (uint32_t)cap) {  // too many to keep: T's next 11 bits from the row
        const Threshold t2 = digit_pass<NT, R, CL>(row, hist, peer, sh, 21, prefix, 10, NB, need);
        count = t1.above + t2.above + t2.at;  // keys whose top 22 bits are >= T's
        f_count = t1.f_above + t2.f_above + t2.f_at;
        f_above += t2.f_above;
        need -= t2.above;
        prefix = (prefix << 11) | t2.digit;
        pshift = 10;
        if (count > (uint32_t)cap) {  // still too many: T's last 10 bits from the row too, select from the row
            const Threshold t3 = digit_pass<NT, R, CL>(row, hist, peer, sh, 10, prefix, 0, NB / 2, need);
            select<NT>(row, (prefix << 10) | t3.digit, need - t3.above, n_sel, before(f_above + t3.f_above),
                before(t3.f_at), out_row, sh);
            return;
        }
    }
    // Steps 2-4 over the candidates in shared memory (each block its own part's).
    const uint32_t own = rank == 0 ? f_count : count - f_count;
    gather<NT, PREFETCH>(row, prefix << pshift, own, ckey, cpos, sh);
    __syncthreads();
    const Cands cands{ckey, cpos, (int)own, 0, (int)((own + 3) / 4)};
    if (pshift == 21) {
        const Threshold t2 = digit_pass<NT, R, CL>(cands, hist, peer, sh, 21, prefix, 10, NB, need);
        f_above += t2.f_above;
        need -= t2.above;
        prefix = (prefix << 11) | t2.digit;
    }
    const Threshold t3 = digit_pass<NT, R, CL>(cands, hist, peer, sh, 10, prefix, 0, NB / 2, need);
    select<NT>(cands, (prefix << 10) | t3.digit, need - t3.above, n_sel, before(f_above + t3.f_above), before(t3.f_at),
        out_row, sh);
}

// Rows of scores [B, L], one per CL blocks (`topk_row`). Launched with programmatic dependent launch (sm_90+,
// `pdl`), the kernel lets the next one launch at once and waits for the one before it before its first read.
// With CL = 2 a row of fewer than SPLIT_MIN_N valid scores is done by the cluster's first block alone, as with
// CL = 1 (the second returns at once, before any distributed shared-memory access): the variant is chosen by
// the scores' width, and decode's graphs are as wide as the engine's longest context, so a short row in a wide
// buffer would otherwise pay the cluster's barriers (4096 of 131072 scores on the H200, session 47: 18.6 us
// split, 17.2 in one block; 64 rows 20.0 / 16.9). SPLIT_MIN_N is cuda_topk.py's CLUSTER_MIN_L, the width from
// which the second block pays.
constexpr int SPLIT_MIN_N = 32768;

template <int R, bool PREFETCH, int CL, int NT>
__global__ void __launch_bounds__(NT, 1) topk_rows_kernel(
    const float* __restrict__ scores,  // [B, L], row stride stride_s
    long long stride_s,
    int L,
    const void* __restrict__ lens,  // [B] int32 or int64
    int lens_is_64,
    int k,
    long long* __restrict__ out,  // [B, k], row stride stride_o
    long long stride_o,
    int cap,
    const void* __restrict__ /*page_table*/,  // the pool rows are the short kernel's alone: always null here
    int /*table_is_64*/,
    long long /*stride_pt*/,
    int /*page_size*/,
    int* __restrict__ /*rows_out*/,
    long long /*stride_r*/) {
    pdl_begin();
    extern __shared__ uint4 dyn_smem[];
    uint32_t* ckey = reinterpret_cast<uint32_t*>(dyn_smem);  // [cap], cap % 4 == 0
    int* cpos = reinterpret_cast<int*>(ckey + cap);  // [cap]
    __shared__ uint32_t hist[NB * R];
    __shared__ Shared sh;

    const int rank = blockIdx.x % CL;  // the block's part of the row
    const long long b = blockIdx.x / CL;
    const long long len = lens_is_64 ? static_cast<const long long*>(lens)[b] : static_cast<const int*>(lens)[b];
    const int n = (int)min(max(len, 0LL), (long long)L);
    const float* row_ptr = scores + b * stride_s;
    long long* out_row = out + b * stride_o;
    if constexpr (CL == 2) {
        if (n < SPLIT_MIN_N) {
            if (rank == 0) topk_row<R, PREFETCH, 1, NT>(row_ptr, n, k, out_row, cap, 0, hist, hist, sh, ckey, cpos);
            return;
        }
    }
    const uint32_t* peer = hist;  // the other block's histogram (CL = 2)
#if __CUDA_ARCH__ >= 900
    if constexpr (CL == 2) peer = cooperative_groups::this_cluster().map_shared_rank(hist, rank ^ 1);
#endif
    topk_row<R, PREFETCH, CL, NT>(row_ptr, n, k, out_row, cap, rank, hist, peer, sh, ckey, cpos);
}

// Short rows in registers (variants 5-8; the header's last paragraph). Thread t holds slots t V .. t V + V - 1,
// so thread order then register order is position order. Each of the four digits has its own 256-bin histogram
// (all four cleared at the start), and every warp reads a digit's bins after the barrier that ends its histogram
// and finds the digit by itself: one barrier a digit. Once the keys under the prefix found so far are exactly
// the ones still needed, the later digits are skipped.

// The digit d of a histogram's need-th largest key: count(digits > d) < need <= count(digits >= d) (d = above =
// at = 0 when total < need). Read by a whole warp after the barrier that ends the histogram: every warp gets the
// same answer from the same bins, without a shared write or another barrier.
struct Digit {
    uint32_t digit, above, at, total;  // the digit, count(digits > d), count(digit == d), count(all digits)
};

__device__ __forceinline__ Digit warp_find_digit(const uint32_t* hist, uint32_t need) {
    const int lane = threadIdx.x & 31;
    const int lo = 8 * (31 - lane);  // this lane's bins lo .. lo + 7: lane 0 has the top 8
    const uint4 x = reinterpret_cast<const uint4*>(hist + lo)[0], y = reinterpret_cast<const uint4*>(hist + lo)[1];
    const uint32_t h[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    uint32_t sum = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += h[i];
    uint32_t incl = sum;  // keys in this lane's bins and every bin above them
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const uint32_t v = __shfl_up_sync(FULL, incl, d);
        if (lane >= d) incl += v;
    }
    uint32_t c = incl - sum, digit = 0, above = 0, at = 0;
    const unsigned owner = __ballot_sync(FULL, c < need && incl >= need);  // one lane when total >= need, else none
#pragma unroll
    for (int i = 7; i >= 0; --i) {
        if (c < need && c + h[i] >= need) {
            digit = lo + i;
            above = c;
            at = h[i];
        }
        c += h[i];
    }
    const int src = owner ? __ffs(owner) - 1 : 0;  // with no owner every lane's answer is 0
    return {__shfl_sync(FULL, digit, src), __shfl_sync(FULL, above, src), __shfl_sync(FULL, at, src),
        __shfl_sync(FULL, incl, 31)};
}

// hist[(key >> shift) & 255] += 1 for every valid key (key != 0) whose bits above the digit are `prefix` (every
// valid key when shift = 24). A warp's lanes with the same bin add once, through their lowest lane.
template <int NK>
__device__ __forceinline__ void short_histogram(const uint32_t (&key)[NK], uint32_t prefix, int shift, uint32_t* hist) {
#pragma unroll
    for (int j = 0; j < NK; ++j) {
        const bool in = key[j] != 0u && (shift == 24 || (key[j] >> (shift + 8)) == prefix);
#if __CUDA_ARCH__ >= 700
        if (__any_sync(FULL, in)) {  // warp-uniform: a later digit's few keys skip most of these
            const uint32_t d = in ? (key[j] >> shift) & 255u : 256u;  // 256: not counted
            const unsigned peers = __match_any_sync(FULL, d);
            if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[d], (uint32_t)__popc(peers));
        }
#else
        if (in) atomicAdd(&hist[(key[j] >> shift) & 255u], 1u);
#endif
    }
}

// Rows of scores [B, L], one block of NT threads a row of at most NT * V slots (the launcher checks every row's
// width); the same arguments as topk_rows_kernel (`cap` unused: no dynamic shared memory). With ROWS (the
// launcher's WITH_ROWS twin, run where rows_out is non-null) every selected position's pool row goes to rows_out
// too, at the same index of its row (-1 where out gets -1): page_table[b, pos / page_size] * page_size + pos %
// page_size, as int32 (the low 32 bits of that product in int64, which is what triton_decode's `selected_rows`
// stores), so that the sparse MLA decode needs no launch of its own for them. Every selected position is
// < n <= lens[b]: never a -1 of `selected_rows`. Without ROWS the page-table arguments are not read (the twin
// keeps the rows' registers out of the kernel that runs without them).
template <int NT, int V, bool ROWS>
__global__ void __launch_bounds__(NT, NT < 512 ? 2 : 1024 / NT) topk_short_kernel(
    const float* __restrict__ scores,  // [B, L], row stride stride_s
    long long stride_s,
    int L,
    const void* __restrict__ lens,  // [B] int32 or int64
    int lens_is_64,
    int k,
    long long* __restrict__ out,  // [B, k], row stride stride_o
    long long stride_o,
    int cap,
    const void* __restrict__ page_table,  // [B, >= ceil(L / page_size)] int32 or int64, unit column stride
    int table_is_64,
    long long stride_pt,  // page_table's row stride (0: one row shared by all)
    int page_size,  // >= 1
    int* __restrict__ rows_out,  // [B, k], row stride stride_r (ROWS only)
    long long stride_r) {
    static_assert(NT % 32 == 0 && NT <= 1024 && 1024 % NT == 0, "whole warps, at most 32 (block_exclusive_scan)");
    static_assert(4 * NT * V < (1 << 30), "a row's key counts fit the 32-bit fields of one block scan");
    constexpr int NK = 4 * V;  // keys a thread
    pdl_begin();
    __shared__ __align__(16) uint32_t hist[4][256];  // one histogram a digit
    __shared__ Shared sh;

    const long long b = blockIdx.x;
    const long long len = lens_is_64 ? static_cast<const long long*>(lens)[b] : static_cast<const int*>(lens)[b];
    const int n = (int)min(max(len, 0LL), (long long)L);
    const float* row_ptr = scores + b * stride_s;
    long long* out_row = out + b * stride_o;
    const int head = (int)((reinterpret_cast<uintptr_t>(row_ptr) >> 2) & 3);
    const int nslots = n > 0 ? (n + head + 3) >> 2 : 0;  // <= NT * V (the launcher's check)
    const float4* base = reinterpret_cast<const float4*>(row_ptr - head);
    const int pos0 = 4 * V * (int)threadIdx.x - head;  // the position of key[0]: key[j] is at pos0 + j

    uint32_t key[NK];
    {
        float4 raw[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const int s = (int)threadIdx.x * V + i;
            raw[i] = s < nslots ? __ldg(base + s) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        for (int i = threadIdx.x; i < 4 * 256; i += NT) (&hist[0][0])[i] = 0u;
#pragma unroll
        for (int i = 0; i < V; ++i) {
            const float x[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int p = pos0 + 4 * i + j;
                key[4 * i + j] = sort_key(x[j], p >= 0 && p < n);
            }
        }
    }
    __syncthreads();

    // Take every key > T and the first `need` keys == T (T = 0, need = 0: every valid key).
    uint32_t T = 0u, need = 0u;
    short_histogram(key, 0u, 24, hist[0]);
    __syncthreads();
    const Digit d0 = warp_find_digit(hist[0], (uint32_t)k);
    const uint32_t n_sel = min(d0.total, (uint32_t)k);
    if (d0.total > (uint32_t)k) {
        uint32_t prefix = d0.digit;  // T's bits above `shift`
        uint32_t at = d0.at;  // keys under `prefix`
        int shift = 24;
        need = (uint32_t)k - d0.above;  // >= 1: keys to take under `prefix`
#pragma unroll 1
        for (int p = 1; p < 4 && at != need; ++p) {  // block-uniform: every warp has the same figures
            shift -= 8;
            short_histogram(key, prefix, shift, hist[p]);
            __syncthreads();
            const Digit d = warp_find_digit(hist[p], need);
            prefix = (prefix << 8) | d.digit;
            need -= d.above;
            at = d.at;
        }
        if (at == need) {  // every key under `prefix` is taken: T just below them, none of its ties taken
            // prefix << shift >= 1: a first digit of 0 (-inf, scores below -1.7e38) with at == need would mean
            // total == k, taken above; under it a valid key's second digit is >= 0x7f.
            T = (prefix << shift) - 1u;
            need = 0u;
        } else {
            T = prefix;  // shift == 0: T is the k-th largest key, `need` of its ties taken
        }
    }

    // Output ranks (as `select`): the keys > T and == T before this thread's, as two 32-bit fields of one scan.
    uint32_t above = 0, tie = 0;
#pragma unroll
    for (int j = 0; j < NK; ++j) {
        above += key[j] > T;
        tie += key[j] == T;
    }
    unsigned long long total;
    const unsigned long long excl = block_exclusive_scan<NT>(above | (unsigned long long)tie << 32, total, sh);
    uint32_t a = (uint32_t)excl, t = (uint32_t)(excl >> 32);
    if constexpr (!ROWS) {
#pragma unroll
        for (int j = 0; j < NK; ++j) {
            if (key[j] > T) {
                out_row[a + min(t, need)] = pos0 + j;
                ++a;
            } else if (key[j] == T) {
                if (t < need) out_row[a + t] = pos0 + j;
                ++t;
            }
        }
        for (long long i = n_sel + threadIdx.x; i < k; i += NT) out_row[i] = -1;
    } else {
        // The same writes, each with its pool row. The thread's positions are consecutive: the page index q and
        // the offset r in the page of pos0 + j go up one position a key, with no division a key (pos0 is floor-
        // divided: it is -3 .. -1 in thread 0 of an unaligned row, whose keys there are invalid, never taken).
        // An int64 page table is read by its entries' low 32-bit words (little-endian), all that the rows need.
        int* rows_row = rows_out + b * stride_r;
        const int wide = table_is_64 ? 1 : 0;
        const int* table = static_cast<const int*>(page_table) + ((b * stride_pt) << wide);
        int q = pos0 / page_size, r = pos0 % page_size;
        if (r < 0) {
            r += page_size;
            --q;
        }
#pragma unroll
        for (int j = 0; j < NK; ++j) {
            int dst = -1;
            if (key[j] > T) {
                dst = (int)(a + min(t, need));
                ++a;
            } else if (key[j] == T) {
                if (t < need) dst = (int)(a + t);
                ++t;
            }
            if (dst >= 0) {  // q >= 0: a taken key's position is valid
                const uint32_t page = (uint32_t)__ldg(table + (q << wide));
                out_row[dst] = pos0 + j;
                rows_row[dst] = (int)(page * (uint32_t)page_size + (uint32_t)r);  // mod 2^32, as selected_rows
            }
            if (++r == page_size) {
                r = 0;
                ++q;
            }
        }
        for (long long i = n_sel + threadIdx.x; i < k; i += NT) {
            out_row[i] = -1;
            rows_row[i] = -1;
        }
    }
}

// Kernel variants, for measuring on the device (scripts/topk_cuda_check.py checks and times each):
// 0: one histogram copy, plain gather, one block a row (the default; on the H200 2026-12-01: 56.6 us for
// 64 x 131072, k = 2048); 1: R = 4 lane-picked copies of every histogram bin (59.3 us); 2: R = 4 and the
// gather's next chunk prefetched (59.4 us); 3 and 4: 0 with 256 and 512 threads a row (for short rows, whose
// 1024 threads mostly wait at the barriers); 5-8: the short rows in registers (`topk_short_kernel<NT, V>`, rows
// of at most ROW_SLOTS 16-byte slots): 5: 512 threads, 2 slots a thread (4096 scores); 6: 1024 threads,
// 2 slots; 7: 512, 4; 8: 256, 8 (8192 scores each); 9: 0 with a cluster of two blocks a row, each reading half
// of it. Variants with clusters come last (`usable_variants`).
constexpr int NUM_VARIANTS = 10;
using Kernel = void (*)(const float*, long long, int, const void*, int, int, long long*, long long, int,
    const void*, int, long long, int, int*, long long);
constexpr Kernel VARIANTS[NUM_VARIANTS] = {topk_rows_kernel<1, false, 1, 1024>, topk_rows_kernel<4, false, 1, 1024>,
    topk_rows_kernel<4, true, 1, 1024>, topk_rows_kernel<1, false, 1, 256>, topk_rows_kernel<1, false, 1, 512>,
    topk_short_kernel<512, 2, false>, topk_short_kernel<1024, 2, false>, topk_short_kernel<512, 4, false>,
    topk_short_kernel<256, 8, false>, topk_rows_kernel<1, false, 2, 1024>};
// The short variants' twins that also write the selected positions' pool rows (`rows_out`; null: none).
constexpr Kernel WITH_ROWS[NUM_VARIANTS] = {nullptr, nullptr, nullptr, nullptr, nullptr,
    topk_short_kernel<512, 2, true>, topk_short_kernel<1024, 2, true>, topk_short_kernel<512, 4, true>,
    topk_short_kernel<256, 8, true>, nullptr};
constexpr int BLOCKS_PER_ROW[NUM_VARIANTS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2};
constexpr int THREADS[NUM_VARIANTS] = {1024, 1024, 1024, 256, 512, 512, 1024, 512, 256, 1024};
// The most 16-byte slots a row may span (NT * V of a short variant; 0: any width); cuda_topk.py's ROW_SLOTS.
constexpr int ROW_SLOTS[NUM_VARIANTS] = {0, 0, 0, 0, 0, 512 * 2, 1024 * 2, 512 * 4, 256 * 8, 0};

// How many variants run on the current device: those with clusters (the last ones) need compute capability 9.
int usable_variants() {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
    int n = 0;
    while (n < NUM_VARIANTS && (BLOCKS_PER_ROW[n] == 1 || major >= 9)) ++n;
    return n;
}

bool g_ready[NUM_VARIANTS][MAX_DEVICES];  // the variant is set up on the device (`setup`)
int g_cap[NUM_VARIANTS][MAX_DEVICES];  // the candidate capacity the device's shared memory allows (0: short variants)
bool g_pdl[MAX_DEVICES];  // the device takes programmatic dependent launch (compute capability 9.0+)

// Set the kernel's dynamic shared-memory limit on this device once (before any graph capture's first call); a
// short variant has none to set, but its attributes are read all the same, and its WITH_ROWS twin's (that fails
// where the library has no code for the device).
cudaError_t setup(int variant, int dev) {
    if (variant >= usable_variants()) return cudaErrorInvalidValue;  // a cluster variant below sm_90
    cudaFuncAttributes attr;
    cudaError_t err;
    if (WITH_ROWS[variant] != nullptr && (err = cudaFuncGetAttributes(&attr, WITH_ROWS[variant])) != cudaSuccess)
        return err;
    err = cudaFuncGetAttributes(&attr, VARIANTS[variant]);
    if (err != cudaSuccess) return err;
    int cap = 0;
    if (ROW_SLOTS[variant] == 0) {
        int optin = 0;
        err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        if (err != cudaSuccess) return err;
        cap = (int)((optin - (long long)attr.sharedSizeBytes - 1024) / 8) & ~3;  // 1 KiB spare
        cap = cap < CAP_MAX ? cap : CAP_MAX;
        if (cap < 4) return cudaErrorInvalidConfiguration;
        err = cudaFuncSetAttribute(VARIANTS[variant], cudaFuncAttributeMaxDynamicSharedMemorySize, cap * 8);
        if (err != cudaSuccess) return err;
    }
    int major = 0;
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return err;
    g_pdl[dev] = major >= 9;
    g_cap[variant][dev] = cap;
    g_ready[variant][dev] = true;
    return cudaSuccess;
}

}  // namespace

namespace {

cudaError_t launch(
    const float* scores,
    long long stride_s,
    int B,
    int L,
    const void* lens,
    int lens_is_64,
    int k,
    long long* out,
    long long stride_o,
    const void* page_table,
    int table_is_64,
    long long stride_pt,
    int page_size,
    int* rows_out,
    long long stride_r,
    void* stream,
    int variant,
    int pdl) {
    if (variant < 0 || variant >= NUM_VARIANTS) return cudaErrorInvalidValue;  // setup checks the device
    if (k < 1 || L < 1 || L > MAX_L || B < 0) return cudaErrorInvalidValue;
    if (B > 1 && (stride_s < L || stride_o < k)) return cudaErrorInvalidValue;  // rows must not overlap
    if (rows_out != nullptr) {  // pool rows: a short variant's alone (its twin), from a page table, rows apart
        if (WITH_ROWS[variant] == nullptr || page_table == nullptr || page_size < 1 || stride_pt < 0)
            return cudaErrorInvalidValue;
        if (B > 1 && stride_r < k) return cudaErrorInvalidValue;
    }
    if (ROW_SLOTS[variant] > 0) {  // a short variant: every row within its slots
        // a row's first score is `head` scores past a 16-byte boundary: the same head for every row when the row
        // stride is a multiple of 4 scores (or there is one row), else up to 3
        const int head = (B <= 1 || stride_s % 4 == 0) ? (int)((reinterpret_cast<uintptr_t>(scores) >> 2) & 3) : 3;
        if (((long long)L + head + 3) / 4 > ROW_SLOTS[variant]) return cudaErrorInvalidValue;
    }
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
    if (!g_ready[variant][dev] && (err = setup(variant, dev)) != cudaSuccess) return err;
    if (B == 0) return cudaSuccess;
    const long long row_cap = ((long long)L + 3) & ~3LL;  // a row never has more candidates than scores
    const int cap = row_cap < g_cap[variant][dev] ? (int)row_cap : g_cap[variant][dev];  // 0: a short variant
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3((unsigned)B * BLOCKS_PER_ROW[variant]);
    config.blockDim = dim3(THREADS[variant]);
    config.dynamicSmemBytes = (size_t)cap * 8;
    config.stream = static_cast<cudaStream_t>(stream);
    cudaLaunchAttribute attrs[2];
    config.attrs = attrs;
    if (BLOCKS_PER_ROW[variant] > 1) {  // one block a row: no cluster attribute
        attrs[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
        attrs[config.numAttrs].val.clusterDim.x = BLOCKS_PER_ROW[variant];
        attrs[config.numAttrs].val.clusterDim.y = 1;
        attrs[config.numAttrs].val.clusterDim.z = 1;
        ++config.numAttrs;
    }
    if (pdl && g_pdl[dev]) {  // may start while the kernel before ends; waits for it before its first read
        attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[config.numAttrs].val.programmaticStreamSerializationAllowed = 1;
        ++config.numAttrs;
    }
    const Kernel kernel = rows_out != nullptr ? WITH_ROWS[variant] : VARIANTS[variant];
    err = cudaLaunchKernelEx(&config, kernel, scores, stride_s, L, lens, lens_is_64, k, out, stride_o, cap,
        page_table, table_is_64, stride_pt, page_size, rows_out, stride_r);
    return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace

// Top-k of B rows on `stream` with kernel `variant` (0: the default), with programmatic dependent launch when
// `pdl` is nonzero and the device takes it; returns a cudaError_t (0: launched).
// Output rows [B, k] int64 with unit column stride. Requires 1 <= k, 0 < L <= 2^31 - 2^20, 0 <= B and, with
// more than one row, row strides of at least L and k, and for a short variant (5-8) rows of at most its
// ROW_SLOTS 16-byte slots (cudaErrorInvalidValue otherwise). With `rows_out` non-null (a short variant only,
// else cudaErrorInvalidValue) the selected positions' pool rows too: rows_out [B, k] int32 (unit column stride,
// row stride stride_r >= k with more than one row), through page_table [B, >= ceil(L / page_size)] (int64 when
// table_is_64, else int32; unit column stride, row stride stride_pt >= 0), page_size >= 1; -1 where out has -1
// (topk_short_kernel). Any error is returned here and cleared, whatever step failed, so that the next launch
// (ours or torch's) does not report it.
extern "C" int kestrel_topk_launch(const float* scores, long long stride_s, int B, int L, const void* lens,
    int lens_is_64, int k, long long* out, long long stride_o, const void* page_table, int table_is_64,
    long long stride_pt, int page_size, int* rows_out, long long stride_r, void* stream, int variant, int pdl) {
    const cudaError_t err = launch(scores, stride_s, B, L, lens, lens_is_64, k, out, stride_o, page_table,
        table_is_64, stride_pt, page_size, rows_out, stride_r, stream, variant, pdl);
    cudaGetLastError();
    return err;
}

// Every variant's setup (the shared-memory limit, for those that take one) on the current device, ahead of any
// launch: the first launch would do it, but a first launch inside a CUDA graph capture must not (cuda_topk.py
// calls this per device first). Only variant 0's failure is returned: another variant that cannot be set up
// fails its own launches instead.
extern "C" int kestrel_topk_setup() {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= MAX_DEVICES) return cudaErrorInvalidDevice;
    for (int v = usable_variants() - 1; v >= 0; --v) {
        if (g_ready[v][dev] || (err = setup(v, dev)) == cudaSuccess) continue;
        if (v == 0) return err;
        cudaGetLastError();  // clear it, so that the next launch does not report it as its own
    }
    return cudaSuccess;
}

// The variants that run on the current device (0 .. n - 1).
extern "C" int kestrel_topk_num_variants() { return usable_variants(); }

// The most 16-byte slots a row of `variant` may span (0: any width; -1: no such variant): cuda_topk.py's ROW_SLOTS.
extern "C" int kestrel_topk_row_slots(int variant) {
    return variant >= 0 && variant < NUM_VARIANTS ? ROW_SLOTS[variant] : -1;
}

extern "C" const char* kestrel_topk_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
