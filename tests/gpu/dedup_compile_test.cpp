// The CUDA models of the sharing contracts compile and link with the broker and the client
// (sharing/cuda_sharing.hpp). Not run: they have not been tried on a GPU yet (docs/dedup.md).
#include "glake/sharing/cuda_sharing.hpp"
#include "glake/sharing/dedup_broker.hpp"
#include "glake/sharing/dedup_client.hpp"

// Every member of both, instantiated over the CUDA models.
template class glake::basic_dedup_broker<glake::cuda_content_verifier>;
template class glake::dedup_client<glake::cuda_shareable_backend, glake::cuda_staged_hasher>;

static_assert(glake::content_hasher<glake::cuda_staged_hasher>);
static_assert(glake::shareable_backend<glake::cuda_shareable_backend>);
static_assert(glake::content_verifier<glake::cuda_content_verifier>);
