/* What a power loss would leave of a SQLite database, for tests/test_power_loss.py:
 * loaded with LD_PRELOAD, after each fsync or fdatasync of a file ending in ".db" or
 * ".db-wal" under $LOOM_DURABLE_DIR that succeeds, it copies the file as it is then to
 * "<file>.durable". The copies are the files as of their last sync: a write made after
 * it is left out, as a power loss could leave it out. The file is read through the fd
 * being synced (pread): opening and closing another fd of the database would drop
 * SQLite's POSIX locks on it. Meant for one writing thread (a write another thread
 * makes between the sync and the copy would be copied too). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int ends_with(const char *text, const char *tail) {
    size_t length = strlen(text), tail_length = strlen(tail);
    return length >= tail_length && strcmp(text + length - tail_length, tail) == 0;
}

static void copy_synced(int fd) {
    const char *watched = getenv("LOOM_DURABLE_DIR");
    if (!watched) return;
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t size = readlink(link, path, sizeof path - 1);
    if (size < 0) return;
    path[size] = '\0';
    if (strncmp(path, watched, strlen(watched)) != 0) return;
    if (!ends_with(path, ".db") && !ends_with(path, ".db-wal")) return;
    char part[PATH_MAX + 16], copy[PATH_MAX + 16];
    snprintf(part, sizeof part, "%s.durable.part", path);
    snprintf(copy, sizeof copy, "%s.durable", path);
    int out = open(part, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0) abort();
    char buffer[1 << 16];
    off_t offset = 0;
    ssize_t got;
    while ((got = pread(fd, buffer, sizeof buffer, offset)) > 0) {
        if (write(out, buffer, (size_t)got) != got) abort();
        offset += got;
    }
    if (got < 0) abort();
    close(out);
    if (rename(part, copy) != 0) abort();
}

int fsync(int fd) {
    static int (*real)(int) = NULL;
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    int result = real(fd);
    if (result == 0) copy_synced(fd);
    return result;
}

int fdatasync(int fd) {
    static int (*real)(int) = NULL;
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    int result = real(fd);
    if (result == 0) copy_synced(fd);
    return result;
}
