;;;; The demo server of `make run`: PARALLEL-EASY-ACCEPTOR where an
;;;; application would have HUNCHENTOOT:EASY-ACCEPTOR.

(defpackage #:hunchentoot-recycling-taskmaster-demo
  (:use #:cl)
  (:export #:main))

(in-package #:hunchentoot-recycling-taskmaster-demo)

(hunchentoot:define-easy-handler (yo :uri "/yo") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "Hey!")

(hunchentoot:define-easy-handler (hello :uri "/hello") ((name :init-form "world"))
  (setf (hunchentoot:content-type*) "text/plain; charset=utf-8")
  (format nil "Hello, ~A!" name))

(hunchentoot:define-easy-handler (slow :uri "/slow") ((ms :parameter-type 'integer :init-form 100))
  (setf (hunchentoot:content-type*) "text/plain")
  (sleep (/ (max 0 (min ms 10000)) 1000))
  (format nil "Slept ~D ms." ms))

(defvar *heap-peak-bytes* 0
  "The most the heap has held, collectable or not, as SAMPLE-HEAP-PEAK has
seen it since the start or the last /stats?reset-peak=1.")

(defun sample-heap-peak ()
  "Keep *HEAP-PEAK-BYTES*, looking at the heap every 20 ms, for ever."
  (loop (setf *heap-peak-bytes* (max *heap-peak-bytes* (sb-kernel:dynamic-usage)))
        (sleep 0.02)))

;;; /stats: the server's statistics and its heap; ?gc=1 collects every
;;; generation first (the heap then holds what is live), ?reset-peak=1
;;; starts the heap's peak again.
(hunchentoot:define-easy-handler (stats :uri "/stats") (gc reset-peak)
  (setf (hunchentoot:content-type*) "text/plain")
  (when (equal gc "1")
    (sb-ext:gc :full t))
  (when (equal reset-peak "1")
    (setf *heap-peak-bytes* (sb-kernel:dynamic-usage)))
  (format nil "~{~(~A~): ~A~%~}heap-bytes: ~D~%heap-peak-bytes: ~D~%dynamic-space-bytes: ~D~%"
          (hunchentoot-recycling-taskmaster:taskmaster-statistics hunchentoot:*acceptor*)
          (sb-kernel:dynamic-usage) *heap-peak-bytes* (sb-ext:dynamic-space-size)))

(hunchentoot:define-easy-handler (metrics :uri "/metrics") ()
  (setf (hunchentoot:content-type*) "text/plain; version=0.0.4")
  (hunchentoot-recycling-taskmaster:prometheus-metrics hunchentoot:*acceptor*))

(hunchentoot:define-easy-handler (session-count :uri "/count") ()
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "~D ~D"
          (setf (hunchentoot:session-value 'count) (1+ (or (hunchentoot:session-value 'count) 0)))
          (sb-posix:getpid)))

;;; Compressed replies (the acceptors are made with :COMPRESSION): /lorem
;;; answers KB KiB of text/html, or of TYPE, the same each time; with
;;; stream=1 written through SEND-HEADERS' stream, gzipped as it is written.

(defun lorem-line (number)
  (format nil "<p>~5,'0D Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod.</p>~%" number))

(hunchentoot:define-easy-handler (lorem :uri "/lorem") ((kb :parameter-type 'integer :init-form 10) type stream)
  (setf (hunchentoot:content-type*) (or type "text/html; charset=utf-8"))
  (let ((lines (* 12 (max 0 (min kb 10240)))))
    (if (equal stream "1")
        (let ((out (flex:make-flexi-stream (hunchentoot:send-headers) :external-format :utf-8)))
          (dotimes (line lines)
            (write-string (lorem-line line) out))
          (finish-output out)
          nil)
        (with-output-to-string (out)
          (dotimes (line lines)
            (write-string (lorem-line line) out))))))

;;; Replies that wait without a thread: /wait?ms=N is answered by the
;;; engine's timer after N ms; /events?channel=C is an event stream that
;;; begins with the serving process's PID, then carries every message
;;; /publish?channel=C&msg=M sends to C -- from any process sharing the
;;; database when PGDATABASE is set.

(hunchentoot:define-easy-handler (wait :uri "/wait") ((ms :parameter-type 'integer :init-form 100))
  (let ((reply (hunchentoot-recycling-taskmaster:defer-reply :timeout 60)))
    (hunchentoot-recycling-taskmaster:call-after
     (max 0 (min ms 50000))
     (lambda ()
       (hunchentoot-recycling-taskmaster:complete-reply
        reply :content-type "text/plain" :body (format nil "waited ~D ms without a thread~%" ms))))
    nil))

(hunchentoot:define-easy-handler (events :uri "/events") ((channel :init-form "demo"))
  (let ((stream (hunchentoot-recycling-taskmaster:start-event-stream)))
    (hunchentoot-recycling-taskmaster:send-event stream (princ-to-string (sb-posix:getpid)) :event "hello")
    (hunchentoot-recycling-taskmaster:subscribe channel stream)
    nil))

(hunchentoot:define-easy-handler (publish :uri "/publish") ((channel :init-form "demo") (msg :init-form ""))
  (setf (hunchentoot:content-type*) "text/plain")
  (format nil "sent to ~D subscribers of process ~D~%"
          (hunchentoot-recycling-taskmaster:publish channel msg) (sb-posix:getpid)))

;;; Websockets: /ws/echo answers each message to its sender, /ws/chat sends
;;; each text message to every client, of every process sharing the
;;; database when PGDATABASE is set (the channel "chat"); /chat.html uses it
;;; from a browser.

(defclass echo-resource (hunchentoot-recycling-websocket:websocket-resource) ())

(defmethod hunchentoot-recycling-websocket:text-message-received ((resource echo-resource) client message)
  (hunchentoot-recycling-websocket:send-text-message client message))

(defmethod hunchentoot-recycling-websocket:binary-message-received ((resource echo-resource) client octets)
  (hunchentoot-recycling-websocket:send-binary-message client octets))

(defclass chat-resource (hunchentoot-recycling-websocket:websocket-resource) ())

(defmethod hunchentoot-recycling-websocket:client-connected ((resource chat-resource) client)
  (hunchentoot-recycling-taskmaster:subscribe "chat" client))

(defmethod hunchentoot-recycling-websocket:text-message-received ((resource chat-resource) client message)
  (declare (ignore client))
  (hunchentoot-recycling-taskmaster:publish "chat" message))

(defvar *websocket-resources*
  (list (cons "/ws/echo" (make-instance 'echo-resource))
        (cons "/ws/chat" (make-instance 'chat-resource))))

(defun find-websocket-resource (request)
  (cdr (assoc (hunchentoot:script-name request) *websocket-resources* :test #'string=)))

(pushnew 'find-websocket-resource hunchentoot-recycling-websocket:*websocket-dispatch-table*)

(defun static-directory ()
  (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster" "demo/static/"))

(defvar *termination-signal* nil
  "The name of the signal that asked the demo to stop, once one has.")

(defun wait-for-termination-signal ()
  "Return the name of SIGINT (Ctrl-C) or SIGTERM once either arrives.  The
handlers only note the signal: the main thread, not a signal handler, stops
the server, so nothing is unwound from inside a handler."
  (setf *termination-signal* nil)
  (flet ((note (name)
           (lambda (signal info context)
             (declare (ignore signal info context))
             (setf *termination-signal* name))))
    (sb-sys:enable-interrupt sb-unix:sigint (note "SIGINT"))
    (sb-sys:enable-interrupt sb-unix:sigterm (note "SIGTERM")))
  (loop until *termination-signal*
        do (sleep 0.1))
  *termination-signal*)

(defun environment-set-p (name)
  "True when the environment variable NAME is set and not empty."
  (plusp (length (or (uiop:getenv name) ""))))

;;; HTTPS: TLS_PORT=q serves the same site over TLS on q, with TLS_CERT and
;;; TLS_KEY or a self-signed certificate for localhost made at start, and
;;; TLS_SNI="name=cert,key;*.name2=cert2,key2" adds certificates by host
;;; name.  Replacing any of these files renews it without a restart.

(defparameter *compression* '(:zstd :br :gzip)
  "The codings the demo's replies are offered in, its preference first.")

(defun self-signed-certificate ()
  "The certificate and key files of a new self-signed certificate for
localhost and 127.0.0.1, valid 30 days, made with the openssl command."
  (let* ((directory (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string)))
         (certificate (format nil "~A/cert.pem" directory))
         (key (format nil "~A/key.pem" directory)))
    (uiop:run-program (list "openssl" "req" "-x509" "-newkey" "rsa:2048" "-nodes" "-days" "30"
                            "-keyout" key "-out" certificate "-subj" "/CN=localhost"
                            "-addext" "subjectAltName=DNS:localhost,IP:127.0.0.1")
                      :output nil :error-output nil)
    (values certificate key)))

(defun sni-certificates (text)
  "The :SSL-CERTIFICATES of TLS_SNI's TEXT: entries name=certificate,key
separated by semicolons."
  (loop for entry in (uiop:split-string text :separator ";")
        for equals = (position #\= entry)
        for comma = (and equals (position #\, entry :start equals))
        when (plusp (length (string-trim " " entry)))
          collect (if comma
                      (list :names (string-trim " " (subseq entry 0 equals))
                            :certificate-file (string-trim " " (subseq entry (1+ equals) comma))
                            :privatekey-file (string-trim " " (subseq entry (1+ comma))))
                      (error "TLS_SNI: ~S is not name=certificate,key." entry))))

(defun make-tls-acceptor (port address store)
  "The demo's HTTPS acceptor on ADDRESS:PORT, or NIL when PORT is NIL."
  (when port
    (multiple-value-bind (certificate key)
        (if (environment-set-p "TLS_CERT")
            (values (uiop:getenv "TLS_CERT") (or (uiop:getenv "TLS_KEY") (uiop:getenv "TLS_CERT")))
            (self-signed-certificate))
      (make-instance 'hunchentoot-recycling-taskmaster:parallel-easy-ssl-acceptor
                     :port port :address address :session-store store :compression *compression* :http2 t
                     :document-root (static-directory)
                     :ssl-certificate-file certificate :ssl-privatekey-file key
                     :ssl-certificates (sni-certificates (or (uiop:getenv "TLS_SNI") ""))))))

(defun main (&key (port 4242) (address "127.0.0.1")
               (tls-port (and (environment-set-p "TLS_PORT") (parse-integer (uiop:getenv "TLS_PORT")))))
  "Serve the demo on ADDRESS:PORT until Ctrl-C or SIGTERM, then stop softly
(requests in flight finish) and return.  Started by systemd's socket
activation (demo/*.socket), serve the socket it passed instead.  Sessions
are kept in PostgreSQL when PGDATABASE is set (the other PG* variables say
where), in the process otherwise, and channels then reach every demo using
the database; REUSE_PORT=1 listens with SO_REUSEPORT, so that several
demos share the port.  TLS_PORT serves it over TLS too (above)."
  (let* ((listen-fd (hunchentoot-recycling-taskmaster:systemd-listen-fd))
         (store (when (environment-set-p "PGDATABASE")
                  (hunchentoot-recycling-taskmaster:make-postgresql-session-store)))
         (acceptor (make-instance 'hunchentoot-recycling-taskmaster:parallel-easy-acceptor
                                  :port port :address address :listen-fd listen-fd
                                  :reuse-port (equal (uiop:getenv "REUSE_PORT") "1")
                                  :session-store store :compression *compression* :http2 t
                                  :document-root (static-directory)))
         (tls-acceptor (make-tls-acceptor tls-port address store)))
    (when store
      (setf hunchentoot-recycling-taskmaster:*channel-bus*
            (hunchentoot-recycling-taskmaster:make-postgresql-channel-bus)))
    (bt:make-thread #'sample-heap-peak :name "heap peak sampler")
    (hunchentoot:start acceptor)
    (when tls-acceptor
      (hunchentoot:start tls-acceptor)
      (format t "~&HTTPS on https://~A:~D/ with ~D certificates (~{~A~^, ~}).~%"
              address (hunchentoot:acceptor-port tls-acceptor)
              (1+ (length (hunchentoot-recycling-taskmaster:acceptor-ssl-certificates tls-acceptor)))
              (cons "its own" (mapcar (lambda (entry) (getf entry :names))
                                      (hunchentoot-recycling-taskmaster:acceptor-ssl-certificates tls-acceptor)))))
    (format t "~&Serving ~:[http://~A:~D/~;~*the socket systemd passed, port ~D~] ~
               (try /yo, /hello?name=you, /slow?ms=500, /wait?ms=500, /events, /publish?msg=hi, /lorem?kb=10, ~
               /count, /stats, /metrics, /index.html, /chat.html), ~
               sessions ~:[in this process~;in ~:*~A~], HTTP/2 too (curl --http2-prior-knowledge). Ctrl-C stops.~%"
            listen-fd address (hunchentoot:acceptor-port acceptor) store)
    (finish-output)
    (let ((signal (wait-for-termination-signal)))
      (hunchentoot:stop acceptor :soft t)
      (when tls-acceptor
        (hunchentoot:stop tls-acceptor :soft t))
      (when hunchentoot-recycling-taskmaster:*channel-bus*
        (hunchentoot-recycling-taskmaster:close-channel-bus hunchentoot-recycling-taskmaster:*channel-bus*))
      (format t "~&~A: stopped after ~D requests.~%" signal
              (getf (hunchentoot-recycling-taskmaster:taskmaster-statistics acceptor) :requests-served))
      (finish-output))))
