/*
 * Stand-in for the NVIDIA driver library on machines without a GPU.
 *
 * The sgl-kernel wheel links libcuda.so.1 and resolves one symbol from it at load
 * time. SGLang's CPU engine never calls it, but the dynamic loader refuses to load
 * the wheel without a library that provides it. Every call here fails with
 * CUDA_ERROR_NO_DEVICE, so nothing can mistake this for a working driver.
 *
 * Built by the installer: gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1
 */

#define CUDA_ERROR_NO_DEVICE 100

int cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
    (void)data;
    (void)attribute;
    (void)ptr;
    return CUDA_ERROR_NO_DEVICE;
}
