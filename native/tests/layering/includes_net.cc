// Compiled by ctest (native/CMakeLists.txt): a net header, from the store layer and from net.
#include "net/conn.h"
