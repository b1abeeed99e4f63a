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

func ExampleResponse() {
	// A receiver that handles messages one by one, not built on the inbox:
	// it answers what became of each, so that the message it refuses does
	// not hold back the others.
	receiver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		batch, err := outboxhttp.DecodeRequest(r, nil, 0)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		resp := outboxhttp.Response{BatchID: batch.ID}
		for _, m := range batch.Messages {
			res := outboxhttp.Result{EventID: m.EventID, Outcome: outboxhttp.Handled}
			if m.EventType == "order.gift_wrapped" {
				res = outboxhttp.Result{EventID: m.EventID, Outcome: outboxhttp.Failed, Error: "gift wrapping is not sold here", Permanent: true}
			}
			resp.Results = append(resp.Results, res)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(resp)
	}))
	defer receiver.Close()

	pub, err := outboxhttp.New(receiver.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = pub.Publish(context.Background(), outbox.Batch{
		ID: "batch-1",
		Messages: []outbox.Message{
			{EventID: "evt-1", EventType: "order.created", AggregateID: "41", Payload: json.RawMessage(`{}`)},
			{EventID: "evt-2", EventType: "order.gift_wrapped", AggregateID: "42", Payload: json.RawMessage(`{}`)},
		},
	})
	// The dispatcher settles each message by the *outbox.PartialError:
	// evt-1 is delivered, evt-2 is dead-lettered with the receiver's reason.
	var partial *outbox.PartialError
	if errors.As(err, &partial) {
		for id, e := range partial.Failed {
			fmt.Printf("%s: %v (permanent: %v)\n", id, e, outbox.IsPermanent(e))
		}
	}
	// Output:
	// evt-2: gift wrapping is not sold here (permanent: true)
}
