/* SIMD width shared by the kernels. W: floats per SIMD register (AVX-512: 16, AVX/AVX2: 8, else 4),
   so that vector types of W floats (or W / 2 doubles) map onto single native registers; wider
   ones than the target has are split by the compiler into slow generic code. The Python side
   reads W from mnemo_simd_width(). */
#ifndef MNEMO_SIMD_H
#define MNEMO_SIMD_H

#ifndef W
#if defined(__AVX512F__)
#define W 16
#elif defined(__AVX__)
#define W 8
#else
#define W 4
#endif
#endif

#endif
