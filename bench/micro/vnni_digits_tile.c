// Would three 8-bit activation digits on AVX-512 VNNI (`vpdpbusd`, the one-token kernels' exact
// scheme) beat f32 FMAs for a batch of rows? One thread, everything in L1: the f32 register tile
// of `packed_gemm_avx512.rs` (R rows x two 16-row panels, one broadcast per row and column) against
// the same tile summing u8 weights x i8 digits, one digit pass at a time, each 32-deep block's
// integer sums converted and scaled into f32 accumulators (d, the digit scale and the block
// offset's m·Σx term). Prints GMAC/s of each and their ratio (> 1: VNNI faster), three times.
//
//   gcc -O3 -march=icelake-server -mtune=znver3 -DR=6 bench/micro/vnni_digits_tile.c -o /tmp/tile && /tmp/tile
//
// Not part of any build; the thirty-ninth round's figures in the README came from it (R = 6, 8, 12).
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef R
#define R 6
#endif
#define BLOCKS 4
#define LEN (BLOCKS*32)
float W[LEN*32] __attribute__((aligned(64)));
float X[R*LEN] __attribute__((aligned(64)));
float S[R*32] __attribute__((aligned(64)));
// f32 kernel: 12 rows x 2 panels
__attribute__((noinline)) void f32k(void){
  __m512 acc[R][2];
  for(int b=0;b<R;b++){acc[b][0]=_mm512_load_ps(S+b*32);acc[b][1]=_mm512_load_ps(S+b*32+16);}
  for(int k=0;k<LEN;k++){
    __m512 w0=_mm512_load_ps(W+k*32), w1=_mm512_load_ps(W+k*32+16);
    #pragma GCC unroll 12
    for(int b=0;b<R;b++){__m512 x=_mm512_set1_ps(X[b*LEN+k]); acc[b][0]=_mm512_fmadd_ps(w0,x,acc[b][0]);acc[b][1]=_mm512_fmadd_ps(w1,x,acc[b][1]);}
  }
  for(int b=0;b<R;b++){_mm512_store_ps(S+b*32,acc[b][0]);_mm512_store_ps(S+b*32+16,acc[b][1]);}
}
// vnni kernel: weights as u8 [block][group8][panel2][16 rows x 4 depth], digits [row][digit3][LEN] i8, scales
uint8_t WB[LEN*32] __attribute__((aligned(64)));
int8_t D[R][3][LEN] __attribute__((aligned(64)));
float XS[R][BLOCKS][3]; // per row per block per digit scale
float DV[BLOCKS][32] __attribute__((aligned(64)));
float MV[BLOCKS][32] __attribute__((aligned(64)));
float XSUM[R][BLOCKS];
__attribute__((noinline)) void vnnik(void){
  __m512 acc[R][2];
  for(int b=0;b<R;b++){acc[b][0]=_mm512_load_ps(S+b*32);acc[b][1]=_mm512_load_ps(S+b*32+16);}
  for(int bl=0;bl<BLOCKS;bl++){
    __m512 dv0=_mm512_load_ps(DV[bl]),dv1=_mm512_load_ps(DV[bl]+16);
    __m512 mv0=_mm512_load_ps(MV[bl]),mv1=_mm512_load_ps(MV[bl]+16);
    for(int d=0;d<3;d++){
      __m512i ia[R][2];
      #pragma GCC unroll 12
      for(int b=0;b<R;b++){ia[b][0]=_mm512_setzero_si512();ia[b][1]=_mm512_setzero_si512();}
      for(int g=0;g<8;g++){
        const uint8_t*wp=WB+(bl*8+g)*128;
        __m512i w0=_mm512_load_si512(wp), w1=_mm512_load_si512(wp+64);
        #pragma GCC unroll 12
        for(int b=0;b<R;b++){__m512i x=_mm512_set1_epi32(*(int32_t*)&D[b][d][bl*32+g*4]); ia[b][0]=_mm512_dpbusd_epi32(ia[b][0],w0,x);ia[b][1]=_mm512_dpbusd_epi32(ia[b][1],w1,x);}
      }
      #pragma GCC unroll 12
      for(int b=0;b<R;b++){__m512 s=_mm512_set1_ps(XS[b][bl][d]);
        acc[b][0]=_mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia[b][0]),dv0),s,acc[b][0]);
        acc[b][1]=_mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia[b][1]),dv1),s,acc[b][1]);}
    }
    #pragma GCC unroll 12
    for(int b=0;b<R;b++){__m512 s=_mm512_set1_ps(XSUM[b][bl]); acc[b][0]=_mm512_fmadd_ps(mv0,s,acc[b][0]);acc[b][1]=_mm512_fmadd_ps(mv1,s,acc[b][1]);}
  }
  for(int b=0;b<R;b++){_mm512_store_ps(S+b*32,acc[b][0]);_mm512_store_ps(S+b*32+16,acc[b][1]);}
}
int main(){
  for(int i=0;i<LEN*32;i++){W[i]=0.001f*(i%7);WB[i]=i%16;}
  for(int i=0;i<R*LEN;i++)X[i]=0.01f*(i%5);
  memset(D,1,sizeof D);
  for(int b=0;b<R;b++)for(int bl=0;bl<BLOCKS;bl++){XSUM[b][bl]=1e-3f;for(int d=0;d<3;d++)XS[b][bl][d]=1e-4f;}
  for(int bl=0;bl<BLOCKS;bl++)for(int i=0;i<32;i++){DV[bl][i]=1e-3f;MV[bl][i]=1e-3f;}
  int N=2000000;
  for(int rep=0;rep<3;rep++){
  double t=now(); for(int i=0;i<N;i++)f32k(); double tf=now()-t;
  t=now(); for(int i=0;i<N;i++)vnnik(); double tv=now()-t;
  double macs=(double)N*R*32*LEN;
  printf("f32: %.1f GMAC/s  vnni3: %.1f GMAC/s  ratio %.2f\n",macs/tf*1e-9,macs/tv*1e-9,tf/tv);
  }
  printf("%f\n",S[0]);
}
