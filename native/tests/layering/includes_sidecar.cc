// Compiled by ctest (native/CMakeLists.txt): a daemon header, from the net layer and from the daemon.
#include "sidecar/flags.h"
