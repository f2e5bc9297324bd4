/* The sequential parts of the chunked linear-attention forms on the CPU: the pass over chunks
   that carries the [K, V] state from one chunk to the next (one per head, forward and reverse),
   and the unit lower-triangular inverse of the delta rule's WY transform (one per chunk).

   In PyTorch each of these is a loop of small operators, about 10-30 µs of dispatch and memory
   traffic per chunk and head; here a head's whole pass is one call, its state stays in L1/L2, and
   the [K, K]·[K, V] product of the delta rule is a register-blocked loop.

   mnemo/ops/_chunked.py has the PyTorch twin of every entry point (used when this library is
   unavailable, and in the tests as the reference):
     scan_mat_fwd / scan_mat_bwd  ↔  scan_matrix / scan_matrix_reverse_  (S ← M S + D)
     scan_dec_fwd / scan_dec_bwd  ↔  scan_decay_ / scan_decay_reverse_   (S ← λ ⊙ S + dS)
     unit_lower_inv              ↔  unit_lower_inverse_
   A job is one head (b, h) (one matrix for unit_lower_inv); jobs are split into thread slots
   (slots.h). Built by mnemo.ops._native; IEEE semantics (no fast-math). */

#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "slots.h"

typedef float cvf32 __attribute__((vector_size(W * sizeof(float))));
typedef double cvf64 __attribute__((vector_size(W * sizeof(float)))); /* W / 2 doubles: one register */

#define S float
#define V cvf32
#define LANES W
#define SUF f32
#include "chunk_scan_body.h"
#undef S
#undef V
#undef LANES
#undef SUF

#define S double
#define V cvf64
#define LANES (W / 2)
#define SUF f64
#include "chunk_scan_body.h"
#undef S
#undef V
#undef LANES
#undef SUF
