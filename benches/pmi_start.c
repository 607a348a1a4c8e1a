/* The MPI program of the PMI benchmarks (benches/pmi_bench.rs), built with
 * Debian's mpicc.mpich: each rank prints wall-clock microseconds when it
 * starts, when MPI_Init returns and when its first MPI_Allreduce returns
 * (the address exchange is done by then), then finalizes. */
#include <mpi.h>
#include <stdio.h>
#include <sys/time.h>

static long long now_us(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (long long)tv.tv_sec * 1000000 + tv.tv_usec;
}

int main(int argc, char **argv) {
    long long start = now_us();
    int rank, size;
    long mine, total;
    MPI_Init(&argc, &argv);
    long long init = now_us();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    mine = rank + 1;
    MPI_Allreduce(&mine, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    long long reduced = now_us();
    printf("PMISTAMP rank=%d size=%d sum=%ld start=%lld init=%lld reduced=%lld\n", rank, size, total, start, init,
           reduced);
    fflush(stdout);
    MPI_Finalize();
    return total == (long)size * (size + 1) / 2 ? 0 : 1;
}
