/*
 * notify.h - tell the service manager how the daemon is doing, as systemd's sd_notify()
 * does for a unit of Type=notify: one datagram ("READY=1", "STOPPING=1") to the socket
 * named by $NOTIFY_SOCKET, a path or, starting with '@', an abstract address.
 *
 * Where $NOTIFY_SOCKET is not set (not started by systemd, or by a unit of another type)
 * every call does nothing. It is not libsystemd: no file descriptors passed, no
 * credentials, no watchdog, no vsock addresses; the variable is read, never unset.
 */
#ifndef ZINF_TOOLS_NOTIFY_H
#define ZINF_TOOLS_NOTIFY_H

/* Send msg (e.g. "READY=1") to $NOTIFY_SOCKET. 0 when sent or when the variable is not
 * set; -EINVAL for an address that is neither a path nor '@'-abstract, or is too long for
 * a Unix socket address; else the -errno of socket() or sendto(). */
int notify_send(const char *msg);

/* The daemon answers on its socket (READY=1), and it has begun to stop (STOPPING=1). A
 * failure is ignored: the service manager, if any, then waits for its own timeout. */
void notify_ready(void);
void notify_stopping(void);

#endif
