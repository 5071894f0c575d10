#include "cmd.h"
int cmd_config(int argc, char **argv) { return 2; }
