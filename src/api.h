/*
 * api.h - what the library's own layers need to know of a zinf_engine * beyond zinf.h:
 * whether it is a client of a daemon (src/service/) rather than an engine of this process,
 * and closing either without the flush that zinf_close makes (for a caller whose state in
 * memory is known to be inconsistent: the last flush stays the saved state).
 */
#ifndef ZINF_API_H
#define ZINF_API_H

#include <stdbool.h>

#include "zinf.h"

bool api_is_remote(zinf_engine *e);
/* zinf_close_unflushed, under the name the library's own tests used first. */
void api_close_unflushed(zinf_engine *e);

#endif
