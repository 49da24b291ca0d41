// Instruction throughput microbenchmarks (zmm) on this CPU.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
static inline uint64_t rdtsc(){ return __rdtsc(); }
#define N 100000000LL
template <class F> double run(const char* name, F f, double ops_per_iter) {
  double best = 1e30;
  for (int r = 0; r < 5; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    float s = f();
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count();
    if (ns < best) best = ns;
    if (s == 12345.f) printf("x");
  }
  printf("%-44s %.3f ns/iter  %.3f ns per op\n", name, best / (N/100), best / (N/100) / ops_per_iter);
  return best;
}
int main() {
  __m512 t0=_mm512_set1_ps(1),t1=_mm512_set1_ps(2),t2=_mm512_set1_ps(3),t3=_mm512_set1_ps(4);
  alignas(64) float mem[64*16];
  for(int i=0;i<64*16;i++) mem[i]=i*1e-9f;
  // 12 independent perm+add chains
  run("vpermps x12 (indep)", [&]{
    __m512i i0=_mm512_set1_epi32(1);
    __m512 a[12]; for(int k=0;k<12;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      for(int k=0;k<12;k++){ a[k]=_mm512_permutexvar_ps(i0, a[k]); __asm__ volatile("" : "+v"(a[k])); }
    }
    float s=0; for(int k=0;k<12;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 12);
  run("vaddps x12 (indep)", [&]{
    __m512 a[12]; for(int k=0;k<12;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      for(int k=0;k<12;k++){ a[k]=_mm512_add_ps(a[k], t0); __asm__ volatile("" : "+v"(a[k])); }
    }
    float s=0; for(int k=0;k<12;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 12);
  run("vfmadd x12 (indep)", [&]{
    __m512 a[12]; for(int k=0;k<12;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      for(int k=0;k<12;k++){ a[k]=_mm512_fmadd_ps(a[k], t1, t0); __asm__ volatile("" : "+v"(a[k])); }
    }
    float s=0; for(int k=0;k<12;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 12);
  run("perm+add pairs x12 (reg table)", [&]{
    __m512i ix[4]; for(int k=0;k<4;k++) ix[k]=_mm512_set1_epi32(k);
    __m512 a[12]; for(int k=0;k<12;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      __asm__ volatile("" : "+v"(t0),"+v"(t1),"+v"(t2));
      for(int k=0;k<12;k++){ a[k]=_mm512_add_ps(a[k], _mm512_permutexvar_ps(ix[k&3], k<4?t0:k<8?t1:t2)); __asm__ volatile("" : "+v"(a[k])); }
    }
    float s=0; for(int k=0;k<12;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 12);
  run("perm(mem table)+add x24", [&]{
    __m512i ix[4]; for(int k=0;k<4;k++) ix[k]=_mm512_set1_epi32(k);
    __m512 a[24]; for(int k=0;k<24;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      const float* m = mem + (it & 7) * 6 * 16;
      __asm__ volatile("" : "+r"(m));
      _Pragma("GCC unroll 8") for(int p=0;p<6;p++){ __m512 T=_mm512_load_ps(m+p*16);
        _Pragma("GCC unroll 8") for(int b=0;b<4;b++){ a[p*4+b]=_mm512_add_ps(a[p*4+b], _mm512_permutexvar_ps(ix[b], T)); } }
    }
    float s=0; for(int k=0;k<24;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 24);
  for (int mode = 0; mode < 3; ++mode)
  run(mode==0?"perm(mem)+fmadd(1) x24":mode==1?"perm(mem)+ half add/half fma x24":"perm(mem)+sub x24 (check)", [&]{
    __m512i ix[4]; for(int k=0;k<4;k++) ix[k]=_mm512_set1_epi32(k);
    const __m512 one=_mm512_set1_ps(1.f);
    __m512 a[24]; for(int k=0;k<24;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      const float* m = mem + (it & 7) * 6 * 16;
      __asm__ volatile("" : "+r"(m));
      _Pragma("GCC unroll 8") for(int p=0;p<6;p++){ __m512 T=_mm512_load_ps(m+p*16);
        _Pragma("GCC unroll 8") for(int b=0;b<4;b++){ __m512 v=_mm512_permutexvar_ps(ix[b], T);
          if (mode==0 || (mode==1 && (b&1))) a[p*4+b]=_mm512_fmadd_ps(v, one, a[p*4+b]); else a[p*4+b]=_mm512_add_ps(a[p*4+b], v);} }
    }
    float s=0; for(int k=0;k<24;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 24);
  run("perm2(mem)+add x24 (vpermt2ps, 2-reg table)", [&]{
    __m512i ix[4]; for(int k=0;k<4;k++) ix[k]=_mm512_set1_epi32(k*5);
    __m512 a[24]; for(int k=0;k<24;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      const float* m = mem + (it & 7) * 6 * 16;
      __asm__ volatile("" : "+r"(m));
      _Pragma("GCC unroll 8") for(int p=0;p<6;p++){ __m512 T=_mm512_load_ps(m+p*32); __m512 T2=_mm512_load_ps(m+p*32+16);
        _Pragma("GCC unroll 8") for(int b=0;b<4;b++){ a[p*4+b]=_mm512_add_ps(a[p*4+b], _mm512_permutex2var_ps(T, ix[b], T2)); } }
    }
    float s=0; for(int k=0;k<24;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 24);
  run("fma 6x4 microkernel (bcast+load)", [&]{
    __m512 a[24]; for(int k=0;k<24;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      const float* m = mem + (it & 7) * 6 * 16;
      __asm__ volatile("" : "+r"(m));
      __m512 B[4]; _Pragma("GCC unroll 8") for(int b=0;b<4;b++) B[b]=_mm512_load_ps(m+b*16+128);
      _Pragma("GCC unroll 8") for(int p=0;p<6;p++){ __m512 A=_mm512_set1_ps(m[p]);
        _Pragma("GCC unroll 8") for(int b=0;b<4;b++){ a[p*4+b]=_mm512_fmadd_ps(A, B[b], a[p*4+b]); } }
    }
    float s=0; for(int k=0;k<24;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 24);
  run("vpermt2ps x12 (indep)", [&]{
    __m512i i0=_mm512_set1_epi32(17);
    __m512 a[12]; for(int k=0;k<12;k++) a[k]=_mm512_set1_ps(k);
    for (long it=0; it<N/100; ++it){
      for(int k=0;k<12;k++){ a[k]=_mm512_permutex2var_ps(a[k], i0, t1); __asm__ volatile("" : "+v"(a[k])); }
    }
    float s=0; for(int k=0;k<12;k++) s+=_mm512_reduce_add_ps(a[k]); return s;}, 12);
  return 0;
}
