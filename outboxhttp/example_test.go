package outboxhttp_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

func ExampleNew() {
	secret := []byte("shared-secret")

	// The receiving service: check the request, then answer with a status the
	// publisher maps to the right outcome.
	receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		batch, err := outboxhttp.DecodeRequest(r, secret, 1<<20)
		switch {
		case errors.Is(err, outboxhttp.ErrBadSignature):
			http.Error(w, "bad signature", http.StatusUnauthorized) // dead-letters the batch
			return
		case errors.Is(err, outboxhttp.ErrTooLarge):
			http.Error(w, "too large", http.StatusRequestEntityTooLarge)
			return
		case err != nil:
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		// DecodeRequest returns a batch only when the signature was valid.
		fmt.Println("signature valid")
		fmt.Println("messages:", len(batch.Messages))
		for _, m := range batch.Messages {
			// Store m, deduplicating on m.EventID, before answering 2xx.
			fmt.Println(m.EventID, m.EventType)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer receiver.Close()

	pub, err := outboxhttp.New(receiver.URL, outboxhttp.WithSecret(secret))
	if err != nil {
		fmt.Println(err)
		return
	}
	err = pub.Publish(context.Background(), outbox.Batch{
		ID: "batch-1",
		Messages: []outbox.Message{
			{EventID: "evt-1", EventType: "order.created", Payload: json.RawMessage(`{"id":42}`)},
			{EventID: "evt-2", EventType: "order.paid", Payload: json.RawMessage(`{"id":42}`)},
		},
	})
	fmt.Println("publish error:", err)
	// Output:
	// signature valid
	// messages: 2
	// evt-1 order.created
	// evt-2 order.paid
	// publish error: <nil>
}
