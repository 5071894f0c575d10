/*
 * notify.c - the service manager's readiness protocol (notify.h): a datagram to
 * $NOTIFY_SOCKET. Written here rather than taken from libsystemd so that zinf depends on
 * nothing of systemd's, at build time or at run time.
 *
 * It sends and forgets: systemd reads its notification socket without replying, and a
 * message that cannot be sent changes nothing in what the daemon does.
 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "notify.h"

int notify_send(const char *msg)
{
    const char *addr = getenv("NOTIFY_SOCKET");
    if (!addr || !addr[0]) return 0;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(addr);
    /* A path needs its NUL in sun_path; an abstract name is its bytes after the leading
     * NUL that stands for '@', and the address length says where it ends. */
    if ((addr[0] != '/' && addr[0] != '@') || len > sizeof(sa.sun_path) ||
        (addr[0] == '/' && len == sizeof(sa.sun_path)))
        return -EINVAL;
    memcpy(sa.sun_path, addr, len);
    if (addr[0] == '@') sa.sun_path[0] = '\0';
    socklen_t sa_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);

    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    int r = 0;
    /* MSG_NOSIGNAL: a peer gone away is an error returned, not a SIGPIPE. */
    if (sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (const struct sockaddr *)&sa, sa_len) < 0)
        r = -errno;
    close(fd);
    return r;
}

void notify_ready(void)
{
    (void)notify_send("READY=1");
}

void notify_stopping(void)
{
    (void)notify_send("STOPPING=1");
}
