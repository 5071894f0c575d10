#include "cmd.h"
int cmd_topo(int argc, char **argv) { return 2; }
