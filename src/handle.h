/*
 * handle.h - what a zinf_engine * points at: an engine of this process (src/engine/) or a
 * client of a zinf daemon (src/service/client.c). Both structs begin with this tag, and
 * src/api.c reads it to route each public call; neither side knows about the other.
 *
 * Not here: the calls themselves (api.c), anything about sockets (src/service/).
 */
#ifndef ZINF_HANDLE_H
#define ZINF_HANDLE_H

#include <stdint.h>

/* Distinct non-zero words, so that a pointer to something else is not taken for either. */
enum handle_kind {
    HANDLE_ENGINE = 0x454e474eu, /* "ENGN" */
    HANDLE_CLIENT = 0x434c4e54u, /* "CLNT" */
};

struct handle {
    uint32_t kind;
};

#endif
