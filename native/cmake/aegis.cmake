# libaegis (Frank Denis, MIT): the AEGIS family of AEADs and AEGIS-MAC
# (draft-irtf-cfrg-aegis-aead), the data port's frame tags and encryption. Its C sources as
# released on PyPI in pyaegis 0.3.1, the author's own binding of it (libaegis itself is not
# published to a package registry this build can reach), pinned by the sdist's SHA-256.
# Compiled into a static library: the sidecar and the Python extension load no library the
# images would lack. The implementation is picked at run time (AES-NI, VAES-AVX2, AVX-512).
include(FetchContent)
set(TPUSYNC_AEGIS_URL
    "https://files.pythonhosted.org/packages/12/d8/6b45fb9f813b08c44807c244f1b8d6e37f208bf4fbbffb13f9c25a7c2217/pyaegis-0.3.1.tar.gz")
set(TPUSYNC_AEGIS_SHA256 dfd29aac950e5d0c521ab22c1a17ae5189e915f76e981d86c3725e92985d1680)
# TPUSYNC_DOWNLOADS (the Makefile's ~/.cache/tpusync/downloads) keeps the tarball between
# build trees; the hash is checked either way.
set(aegis_download_dir)
if(DEFINED ENV{TPUSYNC_DOWNLOADS})
  set(aegis_download_dir DOWNLOAD_DIR "$ENV{TPUSYNC_DOWNLOADS}")
endif()
FetchContent_Declare(aegis URL "${TPUSYNC_AEGIS_URL}" URL_HASH "SHA256=${TPUSYNC_AEGIS_SHA256}"
                     ${aegis_download_dir} DOWNLOAD_EXTRACT_TIMESTAMP TRUE)
FetchContent_MakeAvailable(aegis)  # the sdist has no CMakeLists.txt: sources only
set(aegis_c "${aegis_SOURCE_DIR}/c_src")
# Every variant: aegis_init() picks each one's implementation.
file(GLOB aegis_sources CONFIGURE_DEPENDS
     "${aegis_c}/common/common.c" "${aegis_c}/common/cpu.c" "${aegis_c}/common/softaes.c"
     "${aegis_c}/aegis128l/*.c" "${aegis_c}/aegis128x2/*.c" "${aegis_c}/aegis128x4/*.c"
     "${aegis_c}/aegis256/*.c" "${aegis_c}/aegis256x2/*.c" "${aegis_c}/aegis256x4/*.c")
add_library(tpusync_aegis STATIC ${aegis_sources})
target_include_directories(tpusync_aegis SYSTEM PUBLIC "${aegis_c}/include" PRIVATE "${aegis_c}/common")
set_target_properties(tpusync_aegis PROPERTIES C_STANDARD 11 POSITION_INDEPENDENT_CODE ON)
target_compile_options(tpusync_aegis PRIVATE -O3)
