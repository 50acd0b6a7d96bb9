"""What compute-sanitizer's racecheck makes of each way a value is handed from one warp to another in shared memory.

fa3's persistent grid hands its tile index from the producer warp to the consumer warps through a shared-memory
slot guarded by an mbarrier (fa3_fwd.cu's tile_slot). This probe runs the same hand-off, one way per kernel, in a
CTA of two warps (warp 1 writes the slot, warp 0 reads it and stores what it read), so that a report on fa3 can be
read against what the tool says about a hand-off that is known to be ordered, and one that is known not to be:

    race         no synchronization at all (a real race: the tool must report it)
    syncthreads  st.shared, __syncthreads, ld.shared
    named        st.shared, bar.arrive / bar.sync on a named barrier of 64 threads
    mbarrier     st.shared, mbarrier.arrive (release); mbarrier.try_wait (acquire), ld.shared (fa3's tile slot)

Each run also checks the value read (the kernels are correct but the first):

    for m in race syncthreads named mbarrier; do
        compute-sanitizer --tool racecheck --racecheck-report hazard python3 bench/racecheck_probe.py $m; done
"""
import argparse

import cupy

from fa_variants.jit import flatten

SOURCE = r"""
using namespace fav;
template <int MODE>
__global__ void __launch_bounds__(64) probe(int* out, int value) {
    __shared__ __align__(8) unsigned long long bar;
    __shared__ int slot;
    const u32 b = smem_u32(&bar), s = smem_u32(&slot);
    if (threadIdx.x == 0) {
        mbar_init(b, 1);
        fence_mbar_init();
    }
    __syncthreads();
    const bool writer = threadIdx.x == 32, reader = threadIdx.x < 32;
    if (writer) {
        st_shared(s, value);
        if (MODE == 3) mbar_arrive_if(b, true);
    }
    if (MODE == 1) __syncthreads();
    if (MODE == 2) {
        if (reader) named_sync(1, 64);
        else named_arrive(1, 64);
    }
    if (reader) {
        if (MODE >= 3) mbar_wait(b, 0);
        out[threadIdx.x] = ld_shared(s);
    }
}
"""
MODES = ("race", "syncthreads", "named", "mbarrier")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=MODES)
    a = ap.parse_args()
    mode = MODES.index(a.mode)
    name = f"probe<{mode}>"
    module = cupy.RawModule(code=flatten("common/tma.cuh") + SOURCE, options=("-std=c++17", "-arch=sm_90a"),
                            name_expressions=(name,))
    out = cupy.full(32, -1, dtype=cupy.int32)
    module.get_function(name)((1,), (64,), (out, cupy.int32(12345)))
    cupy.cuda.Device().synchronize()
    got = sorted(set(out.get().tolist()))
    print(f"{a.mode}: read {got}", "(expected [12345])" if a.mode != "race" else "(a race: any value)")


if __name__ == "__main__":
    main()
