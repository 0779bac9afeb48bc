/* A disk whose sync is slow, for bench_concurrency.py --sync-delay-ms: loaded with
 * LD_PRELOAD, it lets each fsync and fdatasync of the process finish, then sleeps
 * SLOW_SYNC_US microseconds before returning, as a disk that takes that long to make
 * a write durable would. It only delays; it never skips or reorders a sync. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

static void after_sync(void) {
    static long delay = -1;
    if (delay < 0) {
        const char *text = getenv("SLOW_SYNC_US");
        delay = text ? atol(text) : 0;
    }
    if (delay > 0) {
        struct timespec pause = {delay / 1000000, (delay % 1000000) * 1000};
        nanosleep(&pause, NULL);
    }
}

int fsync(int fd) {
    static int (*real)(int) = NULL;
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int result = real(fd);
    after_sync();
    return result;
}

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int result = real(fd);
    after_sync();
    return result;
}
