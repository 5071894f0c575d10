/*
 * gnuplot.h - drawing PNGs with gnuplot (Debian's gnuplot-nox, which scripts/setup.sh
 * installs): a temporary directory for its data and script, quoting for its strings, and
 * running it. zinf plot and zinf tune --plot use them.
 */
#ifndef ZINF_TOOLS_GNUPLOT_H
#define ZINF_TOOLS_GNUPLOT_H

#include <stddef.h>
#include <stdio.h>

/* A fresh directory under $TMPDIR (or /tmp) into tmp: 0 or -errno. */
int gnuplot_tmpdir(char *tmp, size_t len);
/* Remove tmp and the files named in it (a NULL-terminated list). */
void gnuplot_rmdir(const char *tmp, const char *const *names);
/* s as a gnuplot single-quoted string ('' stands for a quote). */
void gnuplot_quote(FILE *f, const char *s);
/* Run gnuplot on script: 0 when it succeeded and out is a non-empty file; else 1, with why
 * in one line on stderr after "zinf WHO: " (gnuplot missing: how to install it; gnuplot
 * failed: its exit status and the first line of its message). What gnuplot says on stderr
 * is kept from the terminal: it is shown, in that line, only when gnuplot fails. */
int gnuplot_run(const char *who, const char *script, const char *out);

#endif
