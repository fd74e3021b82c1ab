// Compiled by ctest (native/CMakeLists.txt): the store's public header, from the base layer and from the store.
#include "tpusync/store.h"
