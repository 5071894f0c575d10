/*
 * cmd_job.c - `zinf job list|close|rm|share|unshare --socket PATH`: the jobs of a node's
 * daemon, listed, closed (flushed, their memory given back), removed with all they saved, or
 * shared read-only with every user (a base others fine-tune on), without signalling the
 * daemon. Each asks the daemon (src/service/client.h), which allows a job's
 * owner and root.
 *
 * Not here: what the daemon does (server.c).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd.h"
#include "service/client.h"
#include "service/proto.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: zinf job list --socket PATH\n"
               "       zinf job close NAME --socket PATH\n"
               "       zinf job rm NAME --socket PATH\n"
               "       zinf job share|unshare NAME --socket PATH\n"
               "The jobs of the zinf daemon on PATH (zinf serve) that you may see: yours (root:\n"
               "all). list shows each with its owner, whether it is open, its clients, pins and\n"
               "tensors; close flushes an open job and gives its memory back (a client that\n"
               "attaches later opens it again, as flushed); rm closes it and removes its\n"
               "folders and all it saved. close and rm refuse a job a client is attached to.\n"
               "share lets every user attach to the job read-only (zinf.base_job: a base that\n"
               "their LoRA runs fine-tune on, one copy in the daemon for all); unshare takes\n"
               "that back for sessions to come. Both are kept with the job across restarts.\n"
               "Exit status: 0 done, 1 refused or failed (the reason is printed), 2 bad usage.\n");
}

static const char *why(int r)
{
    switch (r) {
    case -ENOENT: return "no such job (rm, share), or not open (close)";
    case -EBUSY: return "a client is attached to it";
    case -EACCES: return "another user's job";
    case -ECONNREFUSED: return "no zinf daemon listens there";
    default: return strerror(-r);
    }
}

static int list(const char *sock)
{
    struct service_job_status *js;
    size_t n;
    int r = service_status(sock, &js, &n);
    if (r < 0) {
        fprintf(stderr, "zinf job list: %s: %s\n", sock,
                r == -ENOENT ? "no zinf daemon listens there" : why(r));
        return 1;
    }
    printf("%-24s %8s %6s %8s %10s %8s\n", "JOB", "OWNER", "OPEN", "CLIENTS", "PINS", "TENSORS");
    for (size_t i = 0; i < n; i++)
        printf("%-24s %8u %6s %8u %10llu %8llu\n", js[i].name, (unsigned)js[i].owner_uid,
               js[i].open ? "yes" : "saved", (unsigned)js[i].sessions,
               (unsigned long long)js[i].pins, (unsigned long long)js[i].stats.tensors);
    free(js);
    return 0;
}

int cmd_job(int argc, char **argv)
{
    static const struct option opts[] = {{"socket", required_argument, NULL, 's'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *sock = NULL;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 's':
            sock = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    const char *verb = optind < argc ? argv[optind] : NULL;
    bool named = verb && (!strcmp(verb, "close") || !strcmp(verb, "rm") ||
                          !strcmp(verb, "share") || !strcmp(verb, "unshare"));
    if (!sock || !verb || (strcmp(verb, "list") && !named) ||
        argc - optind != (named ? 2 : 1)) {
        fprintf(stderr, "zinf job: %s\n",
                !sock  ? "--socket is required"
                : !verb ? "say list, close NAME, rm NAME, share NAME or unshare NAME"
                        : "list takes no name; close, rm, share and unshare take one");
        usage(stderr);
        return 2;
    }
    if (!named) return list(sock);
    const char *job = argv[optind + 1];
    bool share = !strcmp(verb, "share"), unshare = !strcmp(verb, "unshare");
    int r = share || unshare
                ? service_manage_flags(sock, PROTO_JOB_SHARE, job, share)
                : service_manage(sock, strcmp(verb, "rm") ? PROTO_JOB_CLOSE : PROTO_JOB_REMOVE, job);
    if (r == -EINVAL) {
        fprintf(stderr, "zinf job %s: %s: not a job's name (letters, digits, '.', '_', '-'; at "
                        "most %d bytes; not starting with '.')\n",
                verb, job, PROTO_MAX_JOB);
        return 2;
    }
    if (r < 0) {
        fprintf(stderr, "zinf job %s %s: %s: %s\n", verb, job, sock,
                r == -ENOENT && !strcmp(verb, "close") ? "not open" : why(r));
        return 1;
    }
    printf("zinf job %s: %s %s\n", verb, job,
           share     ? "shared read-only"
           : unshare ? "no longer shared"
           : strcmp(verb, "rm") ? "closed"
                                : "removed");
    return 0;
}
