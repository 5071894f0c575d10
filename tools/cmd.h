/* cmd.h - the subcommands of the zinf CLI. Each returns the process exit status:
 * 0 success, 1 failure at run time, 2 bad usage or bad input. */
#ifndef ZINF_TOOLS_CMD_H
#define ZINF_TOOLS_CMD_H

int cmd_bench(int argc, char **argv);
int cmd_config(int argc, char **argv);
int cmd_launch(int argc, char **argv);
int cmd_topo(int argc, char **argv);
int cmd_plot(int argc, char **argv);
int cmd_compare(int argc, char **argv);
int cmd_stat(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_job(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_tune(int argc, char **argv);
/* zinf tune --mode train (cmd_tune_train.c), which cmd_tune hands the whole command line. */
int cmd_tune_train(int argc, char **argv);

#endif
