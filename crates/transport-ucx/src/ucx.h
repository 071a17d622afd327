/* What bindgen reads: the UCP API of the system's UCX. */
#include <ucp/api/ucp.h>
