/* Thread slots shared by the kernels' entry points. An entry point gets (jobs, nt, slot0, slot1):
   slot s of nt owns the jobs [jobs s / nt, jobs (s + 1) / nt) and its own scratch. Built with
   OpenMP (linked to the libgomp that PyTorch already loaded, so its intra-op threads run the
   slots: they are the ones spinning on the cores after PyTorch's own parallel work), the slots
   [slot0, slot1) run as one parallel loop; otherwise (or for one slot) in turn, and the caller runs
   one slot per thread of its own pool. A single slot never enters an OpenMP region, which keeps a
   forked child (whose inherited OpenMP team has no threads) safe. */
#ifndef MNEMO_SLOTS_H
#define MNEMO_SLOTS_H

#ifdef _OPENMP
#define MNEMO_OMP_FOR _Pragma("omp parallel for schedule(static, 1) num_threads(slot1 - slot0)")
#else
#define MNEMO_OMP_FOR
#endif

#define FOR_SLOTS(RUN)                                                                             \
    do {                                                                                           \
        if (slot1 - slot0 > 1) {                                                                   \
            MNEMO_OMP_FOR                                                                          \
            for (int64_t s_ = slot0; s_ < slot1; s_++) RUN(s_);                                    \
        } else {                                                                                   \
            for (int64_t s_ = slot0; s_ < slot1; s_++) RUN(s_);                                    \
        }                                                                                          \
    } while (0)

#endif
