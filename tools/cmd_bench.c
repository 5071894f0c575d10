#include "cmd.h"
int cmd_bench(int argc, char **argv) { return 2; }
