/*
 * log.c - the library's one logging channel, and what the config reader and the CLI share
 * for talking to people: the size parser and printer, and the nearest spelling of a
 * mistyped name. Logging is for people (notices, the reason behind an error code);
 * programs get the error code.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common.h"
#include "zinf.h"

pthread_mutex_t numa_call_lock = PTHREAD_MUTEX_INITIALIZER;

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static log_sink_fn log_sink;
static void *log_sink_data;
static void (*user_log)(int level, const char *msg, void *user); /* zinf_set_log() */
static void *user_log_data;
static int log_max = -1; /* -1: not read from ZINF_LOG yet */

_Static_assert(LOG_ERROR == ZINF_LOG_ERROR && LOG_WARN == ZINF_LOG_WARN &&
                   LOG_NOTICE == ZINF_LOG_NOTICE && LOG_DEBUG == ZINF_LOG_DEBUG,
               "the public log levels are the internal ones");

/* ZINF_LOG: a level's name or number; anything else is the default, said once. */
static int level_from_env(void)
{
    static const char *const names[] = {"error", "warn", "notice", "debug"};
    const char *v = getenv("ZINF_LOG");
    if (!v || !*v)
        return LOG_NOTICE;
    for (int i = 0; i < 4; i++)
        if (!strcasecmp(v, names[i]) || (v[0] == '0' + i && !v[1]))
            return i;
    if (!strcasecmp(v, "warning"))
        return LOG_WARN;
    fprintf(stderr, "zinf: warning: ZINF_LOG=%s: expected error, warn, notice or debug (or "
                    "0-3); notice is used\n", v);
    return LOG_NOTICE;
}

/* Lock held. */
static int current_level(void)
{
    if (log_max < 0)
        log_max = level_from_env();
    return log_max;
}

log_sink_fn log_set_sink(log_sink_fn fn, void *data, void **old_data)
{
    pthread_mutex_lock(&log_lock);
    log_sink_fn old = log_sink;
    if (old_data)
        *old_data = log_sink_data;
    log_sink = fn;
    log_sink_data = data;
    pthread_mutex_unlock(&log_lock);
    return old;
}

void log_set_level(enum log_level max_level)
{
    pthread_mutex_lock(&log_lock);
    log_max = (int)max_level;
    pthread_mutex_unlock(&log_lock);
}

ZINF_API void zinf_set_log(void (*fn)(int level, const char *msg, void *user), void *user,
                           int level)
{
    pthread_mutex_lock(&log_lock);
    user_log = fn;
    user_log_data = user;
    if (level >= 0)
        log_max = MIN(level, (int)LOG_DEBUG);
    pthread_mutex_unlock(&log_lock);
}

void log_msg(enum log_level level, const char *fmt, ...)
{
    static const char *const names[] = {"error: ", "warning: ", "", "debug: "};
    char msg[1024];
    va_list ap;

    pthread_mutex_lock(&log_lock);
    if ((int)level > current_level()) {
        pthread_mutex_unlock(&log_lock);
        return;
    }
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (log_sink)
        log_sink(level, msg, log_sink_data); /* the tests' capture */
    else if (user_log)
        user_log((int)level, msg, user_log_data);
    else
        fprintf(stderr, "zinf: %s%s\n", names[level], msg);
    pthread_mutex_unlock(&log_lock);
}

int parse_size(const char *s, uint64_t *out)
{
    char *end;
    double v;
    uint64_t mult = 1;

    if (!s || !*s)
        return -EINVAL;
    while (*s == ' ')
        s++;
    /* Decimal only: strtod would also take "0x10", "inf" and "nan". */
    if (!((*s >= '0' && *s <= '9') || *s == '.') || strpbrk(s, "xXpP"))
        return -EINVAL;
    errno = 0;
    v = strtod(s, &end);
    if (end == s || errno == ERANGE || !isfinite(v) || v < 0)
        return end == s ? -EINVAL : -ERANGE;
    switch (*end) {
    case 'k': case 'K': mult = KiB; end++; break;
    case 'm': case 'M': mult = MiB; end++; break;
    case 'g': case 'G': mult = GiB; end++; break;
    case 't': case 'T': mult = GiB * 1024; end++; break;
    default: break;
    }
    if (mult > 1 && (*end == 'i' || *end == 'I'))
        end++;
    if (mult > 1 && (*end == 'b' || *end == 'B'))
        end++;
    if (*end != '\0')
        return -EINVAL;
    v *= (double)mult;
    if (v >= 18446744073709551616.0)
        return -ERANGE;
    if (v != floor(v))
        return -EINVAL; /* a fraction of a byte */
    *out = (uint64_t)v;
    return 0;
}

const char *format_size(uint64_t bytes, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    unsigned u = 0;

    while (v >= 1024 && u + 1 < ARRAY_SIZE(units)) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    else if (v == floor(v))
        snprintf(buf, len, "%.0f %s", v, units[u]);
    else
        snprintf(buf, len, "%.2f %s", v, units[u]);
    return buf;
}

void json_print_string(FILE *f, const char *s)
{
    if (!s) {
        fputs("null", f);
        return;
    }
    fputc('"', f);
    for (; *s; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7f)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

unsigned edit_distance(const char *a, const char *b, unsigned cap)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned before[65], prev[65], row[65]; /* rows i - 2, i - 1 and i of the table */

    if (la > 64 || lb > 64 || (la > lb ? la - lb : lb - la) >= cap)
        return cap;
    for (size_t j = 0; j <= lb; j++)
        prev[j] = (unsigned)j;
    for (size_t i = 1; i <= la; i++) {
        row[0] = (unsigned)i;
        for (size_t j = 1; j <= lb; j++) {
            unsigned best = prev[j - 1] + (a[i - 1] != b[j - 1]);
            best = MIN(best, prev[j] + 1);
            best = MIN(best, row[j - 1] + 1);
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
                best = MIN(best, before[j - 2] + 1);
            row[j] = best;
        }
        memcpy(before, prev, (lb + 1) * sizeof(prev[0]));
        memcpy(prev, row, (lb + 1) * sizeof(row[0]));
    }
    return MIN(prev[lb], cap);
}

const char *nearest_name(const char *word, const char *const *names, size_t n)
{
    size_t len = strlen(word), prefixes = 0;
    const char *best = NULL, *prefix = NULL;
    unsigned best_d = 3;

    for (size_t i = 0; i < n; i++) {
        unsigned d = edit_distance(word, names[i], best_d);
        if (d < best_d && 2 * d < len) {
            best_d = d;
            best = names[i];
        }
        if (len >= 2 && !strncmp(names[i], word, len)) {
            prefix = names[i];
            prefixes++;
        }
    }
    if (best)
        return best;
    return prefixes == 1 ? prefix : NULL;
}
