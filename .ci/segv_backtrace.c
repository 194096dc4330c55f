// A native stack for a process that dies of a fatal signal where gdb is not installed (the lent
// GPU machine): built as a shared library and preloaded (LD_PRELOAD) into the AOTInductor
// child by .ci/gpu_peers_session.sh. On SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT it writes
// glibc's backtrace of the thread that took the signal to stderr (names where the libraries
// export them, as torch's do; library and offset elsewhere), then dies of the signal as the
// process would have. Python's faulthandler, installed after it, prints the Python stacks
// first and then hands the signal back to it.
//
//   cc -O1 -g -shared -fPIC .ci/segv_backtrace.c -o segv_backtrace.so
//   LD_PRELOAD=$PWD/segv_backtrace.so python -X faulthandler -c "..."
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

static void write_text(const char* text) {
  ssize_t ignored = write(STDERR_FILENO, text, strlen(text));
  (void)ignored;
}

static void on_fatal_signal(int signal_number) {
  write_text("\n*** native stack (.ci/segv_backtrace.c) ***\n");
  void* frames[128];
  const int count = backtrace(frames, 128);
  backtrace_symbols_fd(frames, count, STDERR_FILENO);
  write_text("*** end of native stack ***\n");
  // SA_RESETHAND put the default action back: the signal ends the process with its status.
  raise(signal_number);
}

__attribute__((constructor)) static void install_handlers(void) {
  // Its own stack, so that a stack overflow can still be reported.
  static char alternate_stack[1 << 16];
  stack_t stack;
  memset(&stack, 0, sizeof stack);
  stack.ss_sp = alternate_stack;
  stack.ss_size = sizeof alternate_stack;
  sigaltstack(&stack, NULL);
  // backtrace() loads libgcc's unwinder on its first call: not inside the handler.
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_fatal_signal;
  action.sa_flags = SA_RESETHAND | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    sigaction(kSignals[i], &action, NULL);
  }
}
