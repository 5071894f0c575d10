/*
 * keeper.c - the daemon's keeper thread (struct keeper in server_int.h), which holds every
 * session's liveness mutex, and the liveness memfds themselves: what a client's pin table
 * asks before it trusts a slot (see struct keeper for why one thread does all the locking).
 *
 * Not here: when sessions begin and end (session.c).
 */
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "hugemem.h"
#include "service/server_int.h"

static void *keeper_main(void *arg)
{
    struct keeper *kp = arg;
    pthread_mutex_lock(&kp->lock);
    for (;;) {
        while (!kp->todo && !kp->quit)
            pthread_cond_wait(&kp->cv, &kp->lock);
        if (!kp->todo) break;
        /* Taken or let go without kp->lock: the keeper holds liveness mutexes all along, and
         * takes kp->lock while it does, never the other way round. (kp->todo stays set
         * meanwhile: the next request waits.) */
        pthread_mutex_t *m = kp->todo;
        bool hold = kp->hold;
        pthread_mutex_unlock(&kp->lock);
        int r;
        if (hold) {
            r = pthread_mutex_lock(m);
            if (r == EOWNERDEAD) r = pthread_mutex_consistent(m);
        } else {
            r = pthread_mutex_unlock(m);
        }
        pthread_mutex_lock(&kp->lock);
        kp->result = -r;
        kp->todo = NULL;
        pthread_cond_broadcast(&kp->cv);
    }
    pthread_mutex_unlock(&kp->lock);
    return NULL; /* any mutex still held is let go by the kernel, as if the daemon died */
}

static int keeper_ask(struct keeper *kp, pthread_mutex_t *m, bool hold)
{
    pthread_mutex_lock(&kp->lock);
    while (kp->todo) /* another request first */
        pthread_cond_wait(&kp->cv, &kp->lock);
    kp->todo = m;
    kp->hold = hold;
    pthread_cond_broadcast(&kp->cv);
    while (kp->todo == m)
        pthread_cond_wait(&kp->cv, &kp->lock);
    int r = kp->result;
    pthread_mutex_unlock(&kp->lock);
    return r;
}

int keeper_start(struct keeper *kp)
{
    pthread_mutex_init(&kp->lock, NULL);
    pthread_cond_init(&kp->cv, NULL);
    int r = -pthread_create(&kp->thread, NULL, keeper_main, kp);
    kp->started = r == 0;
    return r;
}

void keeper_stop(struct keeper *kp)
{
    if (!kp->started) return;
    pthread_mutex_lock(&kp->lock);
    kp->quit = true;
    pthread_cond_broadcast(&kp->cv);
    pthread_mutex_unlock(&kp->lock);
    pthread_join(kp->thread, NULL);
    pthread_cond_destroy(&kp->cv);
    pthread_mutex_destroy(&kp->lock);
}

/* A session's liveness mutex: in a memfd the client can only map read-only (the mutex's
 * robust-list links are pointers the keeper's glibc follows: a client must never write
 * them), held by the keeper. */
int keeper_live_open(struct service *s, struct session *se)
{
    void *p;
    se->live_fd = hugemem_memfd("zinf-live", PROTO_LIVE_BYTES, &p);
    if (se->live_fd < 0) return se->live_fd;
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int r = -pthread_mutex_init(p, &a);
    pthread_mutexattr_destroy(&a);
    if (r == 0 && (r = keeper_ask(&s->keeper, p, true)) == 0) {
        se->live = p;
        return 0;
    }
    munmap(p, PROTO_LIVE_BYTES);
    close(se->live_fd);
    se->live_fd = -1;
    return r;
}

/* Let go (the client then reads the word as free) and unmapped. */
void keeper_live_close(struct service *s, struct session *se)
{
    if (se->live) {
        keeper_ask(&s->keeper, se->live, false);
        munmap(se->live, PROTO_LIVE_BYTES);
        se->live = NULL;
    }
    if (se->live_fd >= 0) close(se->live_fd);
    se->live_fd = -1;
}
