// Compiled by ctest (native/CMakeLists.txt): a store tier's header, from the net layer and from the store.
#include "store/block_pool.h"
