// Compiled by ctest (native/CMakeLists.txt): the block-store contract (net's), from the store layer and from net.
#include "tpusync/block_store.h"
