// A webhook that does no work, served the way Trainer's webhooks are (Go's net/http over TLS, HTTP/2
// offered): the floor a Go webhook's admission duration sits on, for bench/cluster.py. It answers every
// review allowed, with the JSONPatch in the file named by -patch when one is given.
//
//	nullwebhook -bind 127.0.0.1:PORT -cert tls.crt -key tls.key [-patch patch.json]
package main

import (
	"encoding/json"
	"flag"
	"io"
	"log"
	"net/http"
	"os"
)

func main() {
	bind := flag.String("bind", "", "host:port")
	cert := flag.String("cert", "", "serving certificate")
	key := flag.String("key", "", "its key")
	patchFile := flag.String("patch", "", "a JSONPatch to answer with (none: no patch)")
	flag.Parse()
	var patch []byte
	if *patchFile != "" {
		var err error
		if patch, err = os.ReadFile(*patchFile); err != nil {
			log.Fatal(err)
		}
	}
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("{}")) })
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var review struct {
			Request struct {
				UID string `json:"uid"`
			} `json:"request"`
		}
		if err := json.Unmarshal(body, &review); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		response := map[string]any{"uid": review.Request.UID, "allowed": true}
		if patch != nil {
			response["patchType"] = "JSONPatch"
			response["patch"] = patch // []byte: base64 in JSON, as the API expects
		}
		out, _ := json.Marshal(map[string]any{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
			"response": response})
		w.Header().Set("Content-Type", "application/json")
		w.Write(out)
	})
	log.Fatal(http.ListenAndServeTLS(*bind, *cert, *key, nil))
}
