// How fast can two threads read memory here, and what gets them there? Each thread sums (AVX2)
// its own half of a buffer far larger than L3, as the one-token projections stream their
// weights, in several ways: plainly; with a software prefetch D bytes ahead (t0 / nta / t1);
// and as S streams at once (the half cut into S ranges read a 64-byte line from each in turn,
// so that the hardware prefetchers follow S streams). WORK adds that many integer multiply-adds
// per 32 bytes read (the 4-bit digit kernel runs ~20 vector instructions per 32 bytes), to see
// whether arithmetic and reads overlap. Prints GB/s per variant, in rounds that alternate them.
//
//   gcc -O2 -mavx2 -mfma -pthread bench/micro/read_streams.c -o /tmp/reads && /tmp/reads [MB] [rounds] [work]
//
// Not part of any build; the fortieth round's figures in the README came from it.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { PLAIN, T0, NTA, T1, STREAMS };
typedef struct {
  const uint8_t *base;
  size_t len;
  int kind, distance, streams, work;
  __m256i out;
  pthread_barrier_t *start;
} Job;

static inline __m256i consume(__m256i acc, __m256i v, int work) {
  acc = _mm256_add_epi8(acc, v);
  const __m256i ones = _mm256_set1_epi8(1);
  for (int i = 0; i < work; i++) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(v, ones));
  return acc;
}

static void *run(void *arg) {
  Job *j = arg;
  __m256i a0 = _mm256_setzero_si256(), a1 = a0;
  pthread_barrier_wait(j->start);
  const uint8_t *p = j->base;
  size_t n = j->len;
  if (j->kind == STREAMS) {
    size_t part = n / j->streams / 64 * 64;
    for (size_t off = 0; off < part; off += 64)
      for (int s = 0; s < j->streams; s++) {
        const uint8_t *q = p + s * part + off;
        a0 = consume(a0, _mm256_load_si256((const __m256i *)q), j->work);
        a1 = consume(a1, _mm256_load_si256((const __m256i *)(q + 32)), j->work);
      }
  } else {
    for (size_t off = 0; off < n; off += 64) {
      const char *ahead = (const char *)p + off + j->distance;
      if (off + j->distance < n) {
        if (j->kind == T0) _mm_prefetch(ahead, _MM_HINT_T0);
        else if (j->kind == NTA) _mm_prefetch(ahead, _MM_HINT_NTA);
        else if (j->kind == T1) _mm_prefetch(ahead, _MM_HINT_T1);
      }
      a0 = consume(a0, _mm256_load_si256((const __m256i *)(p + off)), j->work);
      a1 = consume(a1, _mm256_load_si256((const __m256i *)(p + off + 32)), j->work);
    }
  }
  j->out = _mm256_add_epi8(a0, a1);
  return NULL;
}

static double measure(const uint8_t *buf, size_t len, int kind, int distance, int streams, int work) {
  pthread_barrier_t start;
  pthread_barrier_init(&start, NULL, 3);
  Job jobs[2];
  pthread_t threads[2];
  for (int t = 0; t < 2; t++) {
    jobs[t] = (Job){buf + t * (len / 2), len / 2, kind, distance, streams, work, _mm256_setzero_si256(), &start};
    pthread_create(&threads[t], NULL, run, &jobs[t]);
  }
  double t0 = now();
  pthread_barrier_wait(&start);
  for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
  double seconds = now() - t0;
  pthread_barrier_destroy(&start);
  return len / seconds / 1e9;
}

int main(int argc, char **argv) {
  size_t mb = argc > 1 ? atoi(argv[1]) : 512;
  int rounds = argc > 2 ? atoi(argv[2]) : 3;
  int work = argc > 3 ? atoi(argv[3]) : 0;
  size_t len = mb << 20;
  uint8_t *buf = aligned_alloc(4096, len);
  memset(buf, 1, len);
  struct { const char *name; int kind, distance, streams; } variants[] = {
      {"plain", PLAIN, 0, 1},         {"t0 +512", T0, 512, 1},      {"t0 +2K", T0, 2048, 1},
      {"t0 +8K", T0, 8192, 1},        {"nta +2K", NTA, 2048, 1},    {"t1 +2K", T1, 2048, 1},
      {"t1 +8K", T1, 8192, 1},        {"t1 +32K", T1, 32768, 1},    {"2 streams", STREAMS, 0, 2},
      {"4 streams", STREAMS, 0, 4},   {"8 streams", STREAMS, 0, 8},
  };
  int count = sizeof variants / sizeof variants[0];
  printf("%zu MB, two threads, %d multiply-adds per 32 bytes\n", mb, work);
  for (int r = 0; r < rounds; r++) {
    for (int v = 0; v < count; v++)
      printf("%-10s %6.1f GB/s%s", variants[v].name,
             measure(buf, len, variants[v].kind, variants[v].distance, variants[v].streams, work),
             v % 4 == 3 || v == count - 1 ? "\n" : " | ");
    printf("\n");
  }
  return 0;
}
