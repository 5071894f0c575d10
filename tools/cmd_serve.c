/*
 * cmd_serve.c - `zinf serve`: the node's zinf daemon (src/service/server.h). It listens on
 * a Unix socket; trainers attach to a named job with zinf_connect() and every call of
 * zinf.h then acts on that job's engine here. SIGTERM or SIGINT flushes every job and exits
 * 0, so a restart brings every job's tensors back.
 *
 * Without --foreground it goes to the background once the socket accepts connections (the
 * command returns 0 then, so a script may connect right after it), its messages to --log
 * FILE (appended) or nowhere; under systemd use --foreground (packaging/zinf.service.in):
 * the journal takes stderr, and READY=1 goes to $NOTIFY_SOCKET once the socket answers.
 *
 * Not here: anything the daemon does (server.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cmd.h"
#include "notify.h"
#include "tiers/cuda_probe.h"
#include "common.h"
#include "config.h"
#include "service/client.h"
#include "service/proto.h"
#include "service/server.h"

static struct service *running;

static void on_signal(int sig)
{
    (void)sig;
    service_stop(running);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf serve --socket PATH --config FILE [--group NAME]\n"
               "                  [--foreground | --log FILE]\n"
               "       zinf serve --stop --socket PATH\n"
               "Run the node's zinf daemon: trainers connect to PATH (zinf_connect, or\n"
               "zinf.connect) and attach to a named job; each job has its own engine with the\n"
               "config's budgets, its swap files in a folder of its name under each swap\n"
               "directory, and its tensors back, as last flushed, when the daemon restarts.\n"
               "  --socket PATH   the Unix socket to listen on (mode 0600: the caller's uid only)\n"
               "  --config FILE   a DeepSpeed-style config: budgets (zinf section), swap\n"
               "                  directories (offload_*.nvme_path), aio settings; a job's\n"
               "                  device arena on a GPU (zinf.device \"cuda\", or \"auto\" with\n"
               "                  one) is shared with its clients through CUDA IPC\n"
               "  --group NAME    let this group's members connect too (mode 0660); a job\n"
               "                  stays its creator's: other uids are refused\n"
               "  --foreground    stay in the foreground, messages on stderr (for systemd);\n"
               "                  otherwise go to the background once the socket accepts\n"
               "                  connections\n"
               "  --log FILE      in the background, append the messages to FILE (else they\n"
               "                  are dropped)\n"
               "  --stop          ask the daemon on PATH to stop as on SIGTERM (root or the\n"
               "                  daemon's user), and wait until every job is flushed and\n"
               "                  the daemon has exited\n"
               "Limits (zinf.serve in the config): jobs_per_uid 4, max_jobs 64,\n"
               "sessions_per_uid 64, connections_per_uid 256, max_connections 1024 of which\n"
               "reserved_connections 16 for root and the daemon's user (who have no per-uid\n"
               "limits), hello_timeout 10 s, idle_job_close 600 s, write_stage_bytes 1 GiB,\n"
               "stages_per_session 64, tickets_per_session 16384, swap_bytes_per_uid 1 TiB,\n"
               "saved_jobs_per_uid 256.\n"
               "SIGTERM or SIGINT: flush every job, remove the socket, exit 0.\n"
               "Exit status: 0 stopped by SIGTERM/SIGINT (or in the background and serving),\n"
               "1 a runtime failure (the socket cannot be made, a daemon already answers on\n"
               "it), 2 bad usage or a bad config.\n");
}

/* --stop: asks the daemon on sock to stop (root or its own uid), and returns once it has
 * flushed every job and exited: `zinf serve --stop && reboot` loses nothing. */
static int stop_daemon(const char *sock)
{
    int r = service_shutdown(sock);
    if (r < 0) {
        fprintf(stderr, "zinf: serve --stop: %s: %s\n", sock,
                r == -ENOENT || r == -ECONNREFUSED ? "no zinf daemon listens there"
                : r == -EPERM ? "only root or the daemon's own user may stop it"
                              : zinf_strerror(r));
        return 1;
    }
    printf("zinf serve: the daemon on %s stopped\n", sock);
    return 0;
}

int cmd_serve(int argc, char **argv)
{
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"config", required_argument, NULL, 'c'},
                                         {"group", required_argument, NULL, 'g'},
                                         {"foreground", no_argument, NULL, 'f'},
                                         {"log", required_argument, NULL, 'l'},
                                         {"stop", no_argument, NULL, 'x'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *socket_path = NULL, *config_path = NULL, *group = NULL, *log_path = NULL;
    bool foreground = false, stop = false;
    int c;

    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            socket_path = optarg;
            break;
        case 'c':
            config_path = optarg;
            break;
        case 'g':
            group = optarg;
            break;
        case 'f':
            foreground = true;
            break;
        case 'x':
            stop = true;
            break;
        case 'l':
            log_path = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (stop && socket_path && optind == argc && !config_path && !foreground && !log_path && !group)
        return stop_daemon(socket_path);
    if (stop) {
        fprintf(stderr, "zinf: serve: --stop takes --socket PATH and nothing else\n");
        usage(stderr);
        return 2;
    }
    if (optind < argc || !socket_path || !config_path || (foreground && log_path)) {
        fprintf(stderr, "zinf: serve: %s\n",
                optind < argc ? "unexpected arguments"
                : foreground  ? "--log is for the background: with --foreground the messages "
                                "go to stderr"
                              : "--socket and --config are required");
        usage(stderr);
        return 2;
    }
    int log_fd = -1;
    if (log_path &&
        (log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) < 0) {
        fprintf(stderr, "zinf: serve: --log %s: %s\n", log_path, strerror(errno));
        return 2;
    }

    struct zinf_config cfg;
    char err[1024];
    if (config_parse_file(config_path, &cfg, err, sizeof(err)) < 0) {
        fprintf(stderr, "zinf: serve: %s\n", err);
        config_free(&cfg);
        return 2;
    }
    if (cfg.zinf.device == ZINF_DEVICE_CUDA) {
        /* Jobs open when clients attach: a GPU that is not there is said now. */
        struct cuda_probe_info pi;
        if (cuda_probe(&pi) <= cfg.zinf.cuda_device) {
            fprintf(stderr, "zinf: serve: %s: zinf.device \"cuda\" (GPU %d), but %s\n",
                    config_path, cfg.zinf.cuda_device,
                    pi.device_count > 0 ? "no GPU has that number" : pi.reason);
            config_free(&cfg);
            return 2;
        }
    }

    /* A daemon runs for months and frees buffers of every size: a fixed mmap threshold
     * keeps glibc from raising it after the first large free, which would leave every
     * later buffer below it in the heaps, held long after use. Message payloads (1 MiB)
     * stay under it and are reused; staged writes are mapped by themselves. */
    mallopt(M_MMAP_THRESHOLD, 4 << 20);
    struct service_opts so = {.socket_path = socket_path, .config = &cfg, .group = group};
    int r = service_open(&so, &running, err, sizeof(err));
    if (r < 0) {
        fprintf(stderr, "zinf: %s\n", err);
        config_free(&cfg);
        return r == -EINVAL ? 2 : 1;
    }
    if (!foreground) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "zinf: serve: fork: %s\n", strerror(errno));
            service_close(running);
            config_free(&cfg);
            return 1;
        }
        if (pid > 0) {
            printf("zinf serve: listening on %s (pid %d)\n", socket_path, (int)pid);
            service_forget(running); /* the child owns the socket now */
            config_free(&cfg);
            if (log_fd >= 0)
                close(log_fd);
            return 0;
        }
        /* Nothing of the caller's terminal or pipes is kept: whoever started it may wait
         * for their end. */
        setsid();
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null >= 0) {
            dup2(null, STDIN_FILENO);
            dup2(null, STDOUT_FILENO);
            dup2(log_fd >= 0 ? log_fd : null, STDERR_FILENO);
            close(null);
        }
    } else {
        fprintf(stderr, "zinf serve: listening on %s\n", socket_path);
    }

    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (foreground) notify_ready(); /* systemd's Type=notify: the socket answers */
    r = service_run(running);
    notify_stopping(); /* flushing every job may take minutes */
    if (r < 0) fprintf(stderr, "zinf: serve: the listener failed: %s\n", strerror(-r));
    service_close(running); /* flushes every job */
    running = NULL;
    config_free(&cfg);
    fprintf(stderr, "zinf serve: stopped\n");
    if (log_fd >= 0) close(log_fd);
    return r < 0 ? 1 : 0;
}
