// The engine's CPU kernels compiled as one translation unit (noria/engine/kernels/__init__.py builds
// this file and bind.cpp, two compilers side by side).
//
// Each source below includes ATen's tensor, parallel and vector headers, and parsing them was most
// of each source's compile: 7.6-9.4 s of 10.7-11.8 s per source at -O3 on a 2-core AMD EPYC Zen 3
// (g++ 12). Included here, the headers are parsed once. The whole AVX2 build on that machine, from
// an empty folder: 32-35 s and 52-56 s of CPU as five compiles, 19-20 s and 33 s of CPU as these
// two. Helpers stay in each source's anonymous namespace; their names must not repeat across
// sources (the compiler refuses a second definition, but not a second overload: keep them unique).
#include "paged_attention.cpp"
#include "sampling.cpp"
#include "fused.cpp"
#include "int8_linear.cpp"
#include "int4_linear.cpp"  // after int8_linear.cpp: it runs that file's row tiles
