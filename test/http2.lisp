;;;; HTTP/2 (RFC 9113): h2c with prior knowledge on a plain port, h2 by ALPN
;;;; on a TLS one, answered as HTTP/1.1 answers; streams in parallel; the
;;;; limits and the attacks libnghttp2's users met (rapid reset, CONTINUATION
;;;; and SETTINGS floods), idle connections.  The clients are curl, h2load and
;;;; test/http2-client.py (raw frames through Debian's python3-h2).

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite http2 :in all :description "HTTP/2: h2c and h2, streams in parallel, limits and floods.")
(in-suite http2)

(defun curl-reply (url protocol &rest arguments)
  "The status, the headers (an alist of lower-case names and values) and
the body (a Latin-1 string) of what curl gets for URL over PROTOCOL
(:HTTP/1.1, :H2C with prior knowledge, :H2 by ALPN), with ARGUMENTS."
  (let* ((output (uiop:run-program (append (list "curl" "-s" "-k" "-i" "-m" "20"
                                                 (ecase protocol
                                                   (:http/1.1 "--http1.1")
                                                   (:h2c "--http2-prior-knowledge")
                                                   (:h2 "--http2")))
                                           arguments (list url))
                                   :output :string :external-format :latin-1 :ignore-error-status t))
         (head-end (search (crlf-lines "" "") output)))
    (if (null head-end)
        (values nil '() output)
        (let ((lines (cl-ppcre:split "\\r\\n" (subseq output 0 head-end))))
          (values (parse-integer (second (cl-ppcre:split " " (first lines))))
                  (loop for line in (rest lines)
                        for colon = (position #\: line)
                        when colon
                          collect (cons (string-downcase (subseq line 0 colon))
                                        (string-trim " " (subseq line (1+ colon)))))
                  (subseq output (+ head-end 4)))))))

(defun comparable-headers (headers)
  "HEADERS as two replies to one request may be compared: without those
HTTP/2 leaves out or that differ from reply to reply (Date, a session
cookie's value), sorted."
  (sort (loop for (name . value) in headers
              unless (member name '("date" "connection" "keep-alive" "transfer-encoding" "content-length")
                             :test #'string=)
                collect (if (string= name "set-cookie")
                            (cons name (subseq value 0 (position #\= value)))
                            (cons name value)))
        #'string< :key (lambda (header) (format nil "~A: ~A" (car header) (cdr header)))))

(ht:define-easy-handler (test-http2-defer-after-headers :uri "/test/http2/defer-after-headers") ()
  ;; Refused (REPLY-NOT-DEFERRABLE) over either protocol: the reply has begun.
  (setf (ht:content-type*) "text/plain")
  (ht:send-headers)
  (defer-reply))

(defun http2-server (&rest initargs)
  (apply #'make-server 'parallel-easy-acceptor :http2 t initargs))

(defun http2-ssl-server (&rest initargs)
  (multiple-value-bind (certificate key) (certificate-files)
    (apply #'make-server 'parallel-easy-ssl-acceptor :http2 t
           :ssl-certificate-file certificate :ssl-privatekey-file key initargs)))

(defparameter *http2-compared-requests*
  `(("/test/yo")
    ("/test/params?a=1&b=%C3%A9")
    ("/test/params" "-d" "a=1&b=two")
    ("/test/set-cookie?value=vanilla")
    ("/test/get-cookie" "-H" "Cookie: other=1; flavour=mint")
    ("/test/body" "--data-binary" "0123456789abcdef" "-H" "Content-Type: application/octet-stream")
    ("/test/chunked-reply")
    ("/test/utf-8?name=%E4%B8%96")
    ("/test/error")
    ("/no/such/page")
    ("/test/large" "-I")
    ("/img/made-with-lisp-logo.jpg")
    ("/img/made-with-lisp-logo.jpg" "-H" "Range: bytes=10-99")
    ("/img/made-with-lisp-logo.jpg" "-H" "If-Modified-Since: Fri, 01 Jan 2100 00:00:00 GMT"))
  "Requests (a path and curl's arguments) whose replies must be the same
over HTTP/1.1 and HTTP/2.")

(defun check-replies-as-on-http/1.1 (server protocol)
  "Each of *HTTP2-COMPARED-REQUESTS* answered over PROTOCOL as over HTTP/1.1."
  (loop for (path . arguments) in *http2-compared-requests*
        do (multiple-value-bind (status headers body) (apply #'curl-reply (url server path) :http/1.1 arguments)
             (multiple-value-bind (status2 headers2 body2) (apply #'curl-reply (url server path) protocol arguments)
               (is (eql status status2) "~A ~A: ~A over HTTP/1.1, ~A over ~A" path arguments status status2 protocol)
               (is (equal body body2) "~A ~A: the bodies differ (~D and ~D octets)"
                   path arguments (length body) (length body2))
               (is (equal (comparable-headers headers) (comparable-headers headers2))
                   "~A ~A: headers ~S over HTTP/1.1, ~S over ~A"
                   path arguments (comparable-headers headers) (comparable-headers headers2) protocol)))))

(test http2.h2c-and-h2-answer-as-http/1.1
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (check-replies-as-on-http/1.1 server :h2c)
      (is (plusp (stats server :http2-connections)))
      (multiple-value-bind (status headers) (curl-reply (url server "/test/yo") :h2c)
        (is (eql 200 status))
        (is (null (assoc "connection" headers :test #'string=)) "no Connection header over HTTP/2"))
      (is (eql 0 (search "HTTP/1.1 200" (uiop:run-program (list "curl" "-s" "-i" "--http2" (url server "/test/yo"))
                                                          :output :string)))
          "Upgrade: h2c is answered as HTTP/1.1, as nginx answers it"))
    (with-server (server (http2-ssl-server))
      (check-replies-as-on-http/1.1 server :h2)
      (is (eql (length *http2-compared-requests*)
               (cdr (assoc "h2" (stats server :tls-handshakes-by-protocol) :test #'string=)))
          "each h2 handshake counted as h2: ~S" (stats server :tls-handshakes-by-protocol)))))

(test http2.session-and-upload-as-on-http/1.1
  (with-thread-leak-check ()
    (with-server (server (http2-ssl-server))
      (let ((jar (format nil "~Ajar" (make-scratch-folder))))
        (is (equal '("1" "2" "3")
                   (loop for protocol in '(:h2 :http/1.1 :h2)
                         collect (nth-value 2 (curl-reply (url server "/test/session") protocol
                                                          "-b" jar "-c" jar))))
            "over TLS, a session counter goes on across h2 and HTTP/1.1 requests")))
    (with-server (server (http2-server))
      (let ((jar (format nil "~Ajar" (make-scratch-folder))))
        (is (equal '("1" "2" "3" "4")
                   (loop for protocol in '(:h2c :h2c :http/1.1 :h2c)
                         collect (nth-value 2 (curl-reply (url server "/test/session") protocol
                                                          "-b" jar "-c" jar))))
            "a session counter goes on across HTTP/2 and HTTP/1.1 requests")
        (let ((file (format nil "~Aupload.bin" (make-scratch-folder))))
          (with-open-file (out file :direction :output :element-type '(unsigned-byte 8))
            (dotimes (i 300000) (write-byte (mod (* i 31) 256) out)))
          (is (equal (nth-value 2 (curl-reply (url server "/test/upload") :http/1.1 "-F" (format nil "file=@~A" file)))
                     (nth-value 2 (curl-reply (url server "/test/upload") :h2c "-F" (format nil "file=@~A" file))))
              "a multipart upload of 300,000 octets reads the same"))))))

(test http2.off-by-default
  (with-thread-leak-check ()
    (with-server (server (make-server 'parallel-easy-acceptor))
      (is (not (eql 200 (curl-reply (url server "/test/yo") :h2c)))
          "without :HTTP2 the preface is no request")
      (is (eql 200 (curl-reply (url server "/test/yo") :http/1.1)))
      (is (zerop (stats server :http2-connections))))
    (multiple-value-bind (certificate key) (certificate-files)
      (with-server (server (make-server 'parallel-easy-ssl-acceptor
                                        :ssl-certificate-file certificate :ssl-privatekey-file key))
        (multiple-value-bind (status) (curl-reply (url server "/test/yo") :h2 "-w" "%{http_version}")
          (is (eql 200 status)))
        (is (search "HTTP/1.1 200" (uiop:run-program (list "curl" "-s" "-k" "-i" "--http2" (url server "/test/yo"))
                                                     :output :string))
            "ALPN does not choose h2 without :HTTP2")))))

(defun h2load (url &rest arguments)
  "h2load's report for URL with ARGUMENTS: requests succeeded and failed,
and the seconds it took."
  (let ((output (uiop:run-program (append (list "timeout" "60" "h2load") arguments (list url))
                                  :output :string :ignore-error-status t)))
    (multiple-value-bind (match groups)
        (cl-ppcre:scan-to-strings "(?s)finished in ([0-9.]+)(m?s),.*?(\\d+) succeeded, (\\d+) failed" output)
      (if match
          (values (parse-integer (aref groups 2)) (parse-integer (aref groups 3))
                  (* (read-from-string (aref groups 0)) (if (string= (aref groups 1) "ms") 1/1000 1)))
          (values 0 nil output)))))

(test http2.slow-streams-run-in-parallel
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (multiple-value-bind (succeeded failed seconds) (h2load (url server "/test/sleep?ms=300") "-n" "50" "-c" "1" "-m" "50")
        (is (eql 50 succeeded) "50 streams of a 300 ms handler on one connection answered (~S ~S)" failed seconds)
        (is (and (realp seconds) (< seconds 1.5)) "all within 1.5 s: ~A s" seconds))
      (is (eql 0 (stats server :http2-streams-refused))))))

(test http2.a-slow-stream-delays-no-other
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (dolist (paths '(("/test/sleep?ms=1000" "/test/yo") ("/test/yo" "/test/sleep?ms=1000" "/test/yo")))
        (let* ((result (apply #'http2-client "timed" (ht:acceptor-port server) paths))
               (milliseconds (cl-ppcre:all-matches-as-strings "\\d+" (subseq result (position #\[ result)))))
          (is (eql (length paths) (length milliseconds)) "every stream answered: ~A" result)
          (loop for path in paths
                for ms in (mapcar #'parse-integer milliseconds)
                do (if (search "sleep" path)
                       (is (>= ms 1000) "~A took its second: ~A" path result)
                       (is (< ms 300) "~A beside a slow stream answered at once: ~A" path result))))))))

(test http2.preface-waits-for-a-worker-when-none-is-free
  ;; While every worker is busy the sweep looks at what arrived, as a
  ;; worker would: the preface is no HTTP/1.1 head to refuse with 505.
  (with-thread-leak-check ()
    (with-server (server (http2-server :taskmaster (make-instance 'recycling-taskmaster :max-thread-count 2 :standby-thread-count 1)))
      (let ((busy (loop repeat 2 collect (in-thread (lambda () (http-get server "/test/sleep?ms=1500"))))))
        (sleep 0.3)
        (multiple-value-bind (status headers body) (curl-reply (url server "/test/yo") :h2c)
          (declare (ignore headers))
          (is (eql 200 status) "h2c answered once a worker is free: ~A ~A" status body))
        (dolist (join busy)
          (is (eql 200 (first (funcall join))))))
      (is (eql 1 (stats server :http2-connections))))))

(test http2.streams-past-the-limit-are-refused
  (with-thread-leak-check ()
    (with-server (server (http2-server :http2-max-concurrent-streams 4))
      ;; 4 streams whose handlers take 300 ms, reset by the client once
      ;; they run, then 4 more: those find 4 handlers running still.
      (let ((result (http2-client "refill" (ht:acceptor-port server) 4 "/test/sleep?ms=300")))
        (is (search "\"refused\": 4" result) "the 4 streams after the resets refused: ~A" result))
      (is (eql 4 (stats server :http2-streams-refused)))
      (is (eql 200 (curl-reply (url server "/test/yo") :h2c)) "new connections are served"))))

(defun http2-client (&rest arguments)
  "The JSON line test/http2-client.py prints for ARGUMENTS."
  (uiop:run-program (list* "timeout" "60" "/usr/bin/python3"
                           (namestring (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster"
                                                                      "test/http2-client.py"))
                           (mapcar #'princ-to-string arguments))
                    :output :string :ignore-error-status t))

(defun answered-meanwhile (server function)
  "Call FUNCTION in a thread; meanwhile GET /test/yo from SERVER over
HTTP/1.1 and h2c, every 50 ms until it returns.  Its value, the longest any
GET took in seconds, whether each was answered 200, and the most threads
the process had."
  (let ((thread (bt:make-thread function :name "attacking client"))
        (longest 0)
        (all-ok t)
        (most-threads 0))
    (loop do (let ((start (get-internal-real-time)))
               (unless (and (eql 200 (http-get server "/test/yo"))
                            (eql 200 (curl-reply (url server "/test/yo") :h2c)))
                 (setf all-ok nil))
               (setf longest (max longest (/ (- (get-internal-real-time) start) internal-time-units-per-second))
                     most-threads (max most-threads (length (bt:all-threads)))))
             (sleep 0.05)
          while (bt:thread-alive-p thread))
    (values (bt:join-thread thread) longest all-ok most-threads)))

(test http2.rapid-reset-and-floods-end-the-connection
  (with-thread-leak-check ()
    (with-server (server (http2-server :taskmaster (make-instance 'recycling-taskmaster :max-thread-count 16)))
      (let ((threads-before (length (bt:all-threads))))
        (loop for (what . arguments) in '(("rapid-reset" 20000 "/test/sleep?ms=100")
                                          ("continuation" 10000)
                                          ("settings-flood" 100000))
              do (multiple-value-bind (result longest all-ok most-threads)
                     (answered-meanwhile server (lambda () (apply #'http2-client what (ht:acceptor-port server) arguments)))
                   (is (search "\"closed\": true" result) "~A: the server ended the connection: ~A" what result)
                   (is (cl-ppcre:scan "\"goaway\": [1-9]" result) "~A: with a GOAWAY giving an error: ~A" what result)
                   (is-true all-ok "~A: /test/yo answered 200 throughout" what)
                   (is (< longest 1) "~A: /test/yo within 1 s (~,3F s)" what longest)
                   (is (<= most-threads (+ threads-before 16 2)) "~A: ~D threads, the pool's maximum 16"
                       what most-threads))))
      (is (<= 3 (+ (cdr (assoc "protocol-error" (stats server :http2-goaways-by-cause) :test #'string=))
                  (cdr (assoc "flood" (stats server :http2-goaways-by-cause) :test #'string=))))
          "the three GOAWAYs counted: ~S" (stats server :http2-goaways-by-cause))
      (is (plusp (stats server :http2-streams-reset))))))

(test http2.idle-connections-hold-no-thread
  (with-thread-leak-check ()
    (with-server (server (http2-server :keep-alive-timeout 3))
      (let* ((threads-before (length (bt:all-threads)))
             (output (format nil "~Aidle.json" (make-scratch-folder)))
             (process (uiop:launch-program (list "timeout" "60" "/usr/bin/python3"
                                                 (namestring (asdf:system-relative-pathname
                                                              "hunchentoot-recycling-taskmaster" "test/http2-client.py"))
                                                 "idle" (princ-to-string (ht:acceptor-port server)) "1000" "6")
                                           :output output)))
        (unwind-protect
             (progn
               (is (wait-until (lambda () (plusp (log-lines-matching output "\"ready\": 1000"))) :timeout 40)
                   "1,000 HTTP/2 connections opened")
               (is (search "\"settings_received\": 1000" (uiop:read-file-string output))
                   "each got the server's SETTINGS")
               (is (eql 1000 (stats server :open-http2-connections)))
               (is (<= (length (bt:all-threads)) (+ threads-before 4))
                   "1,000 idle connections hold no thread: ~D threads, ~D before"
                   (length (bt:all-threads)) threads-before)
               (is (wait-until (lambda () (zerop (stats server :open-http2-connections))) :timeout 20)
                   "closed after the keep-alive timeout")
               (is (eql 1000 (cdr (assoc "idle" (stats server :http2-goaways-by-cause) :test #'string=)))
                   "each with a GOAWAY: ~S" (stats server :http2-goaways-by-cause))
               (uiop:wait-process process)
               (is (search "\"closed_by_server\": 1000" (uiop:read-file-string output))))
          (stop-process process))))))

(test http2.a-client-that-reads-nothing-is-bounded
  ;; 20 streams of 10 MiB with the largest windows, nothing read: what waits
  ;; for the client is counted in the memory budget, the streams past the
  ;; connection's share of it wait their turn, and the server closes the
  ;; connection holding it (the write timeout) while the client sleeps.
  (with-thread-leak-check ()
    (with-server (server (http2-server :memory-budget (* 32 1024 1024) :write-timeout 3 :read-timeout 3))
      (let ((client (bt:make-thread (lambda () (http2-client "not-reading" (ht:acceptor-port server)
                                                             20 "/test/large" 10))
                                    :name "not-reading client")))
        (is (wait-until (lambda () (eql 1 (stats server :open-http2-connections)))) "connected")
        (is (wait-until (lambda () (zerop (stats server :open-http2-connections))) :timeout 7)
            "closed by the server while the client still sleeps")
        (is-true (bt:thread-alive-p client) "the client still sleeps")
        ;; Answered while the client still sleeps (how soon is not timed in a test).
        (is (eql 200 (http-get server "/test/yo")))
        (is-true (bt:thread-alive-p client) "answered while the client still sleeps")
        (bt:join-thread client))
      (is (<= (stats server :memory-peak-bytes) (* 40 1024 1024))
          "held at most the budget and a reply: ~D octets" (stats server :memory-peak-bytes))
      (is (wait-until (lambda () (zerop (stats server :memory-held-bytes))))
          "all given back: ~D" (stats server :memory-held-bytes))
      (let ((answered (reduce #'+ (stats server :replies-by-class) :key #'cdr)))
        (is (< answered 20) "the streams past the share waited, not made: ~D answered" answered))
      (is (eql 1 (cdr (assoc "slow-reader" (stats server :http2-goaways-by-cause) :test #'string=)))
          "its GOAWAY counted: ~S" (stats server :http2-goaways-by-cause)))))

(test http2.limits-answered-431-and-413
  (with-thread-leak-check ()
    (with-server (server (http2-server :max-body-bytes 1000))
      (is (eql 431 (curl-reply (url server "/test/yo") :h2c "-H" (format nil "X-Big: ~A" (make-string 20000 :initial-element #\a)))))
      (is (eql 413 (curl-reply (url server "/test/body") :h2c "--data-binary" (make-string 2000 :initial-element #\b))))
      (is (eql 200 (curl-reply (url server "/test/body") :h2c "--data-binary" (make-string 900 :initial-element #\b))))
      (is (eql 200 (curl-reply (url server "/test/yo") :h2c)) "the server answers on"))))

(test http2.soft-stop-lets-streams-in-flight-finish
  (with-thread-leak-check ()
    (let ((server (http2-server)))
      (ht:start server)
      (let ((client (in-thread (lambda () (http2-client "timed" (ht:acceptor-port server) "/test/sleep?ms=700")))))
        (is (wait-until (lambda () (eql 1 (stats server :in-request-threads)))))
        (ht:stop server :soft t)
        (let ((result (first (funcall client))))
          (is (cl-ppcre:scan "\\[\\d+\\]" result) "the stream begun before the stop answered: ~A" result))))))

(test http2.stop-sends-goaway
  (with-thread-leak-check ()
    (let ((server (http2-server)))
      (ht:start server)
      (let* ((socket (connect server))
             (stream (usocket:socket-stream socket)))
        (unwind-protect
             (progn
               (write-sequence (flex:string-to-octets (format nil "PRI * HTTP/2.0~C~C~C~CSM~C~C~C~C"
                                                              #\Return #\Linefeed #\Return #\Linefeed
                                                              #\Return #\Linefeed #\Return #\Linefeed))
                               stream)
               (write-sequence #(0 0 0 4 0 0 0 0 0) stream)
               (finish-output stream)
               (is (wait-until (lambda () (eql 1 (stats server :open-http2-connections)))))
               (ht:stop server)
               (let ((octets (loop for octet = (handler-case (read-byte stream nil nil) (error () nil))
                                   while octet collect octet)))
                 (is (search '(7 0 0 0 0 0) octets) "a GOAWAY frame (type 7) came before the close")))
          (usocket:socket-close socket))))))

(test demo.serves-h2c-and-h2
  ;; make run PORT=p TLS_PORT=q: h2c with prior knowledge on p, h2 on q.
  (with-scratch-folder (directory)
    (let* ((port (free-port))
           (tls-port (free-port))
           (log (concatenate 'string directory "demo.log"))
           (process (launch-demo port log :environment (cons (format nil "TLS_PORT=~D" tls-port)
                                                             (sb-ext:posix-environ)))))
      (is-true process "the demo starts")
      (when process
        (unwind-protect
             (let ((plain (format nil "http://127.0.0.1:~D" port))
                   (tls (format nil "https://127.0.0.1:~D" tls-port)))
               (is (equal "Hey!" (nth-value 2 (curl-reply (format nil "~A/yo" plain) :h2c))))
               (is (equal "Hey!" (nth-value 2 (curl-reply (format nil "~A/yo" tls) :h2))))
               (multiple-value-bind (status headers body)
                   (curl-reply (format nil "~A/lorem?kb=10" tls) :h2 "-H" "Accept-Encoding: gzip")
                 (is (eql 200 status))
                 (is (equal "gzip" (cdr (assoc "content-encoding" headers :test #'string=))))
                 (is (< (length body) 4000) "10 KiB coded over HTTP/2: ~D octets" (length body)))
               (is (search "HTTP/2 200" (uiop:run-program (list "curl" "-s" "-I" "--http2-prior-knowledge"
                                                                (format nil "~A/index.html" plain))
                                                          :output :string))
                   "a static file over h2c")
               (is (search "open_http2_connections" (nth-value 2 (curl-reply (format nil "~A/metrics" plain) :h2c)))
                   "the metrics name HTTP/2's"))
          (stop-process process))))))

;;; Under load: every octet in, every octet out, no silent close, no
;;; client that takes the pool or costs without end.

(ht:define-easy-handler (test-bytes :uri "/test/bytes") ((kb :parameter-type 'integer))
  (setf (ht:content-type*) "application/octet-stream")
  (let ((octets (make-array (* 1024 (or kb 1)) :element-type '(unsigned-byte 8))))
    (dotimes (i (length octets) octets)
      (setf (aref octets i) (mod i 251)))))

(ht:define-easy-handler (test-digest :uri "/test/digest") ()
  (setf (ht:content-type*) "text/plain")
  (ironclad:byte-array-to-hex-string (ironclad:digest-sequence :sha1 (or (ht:raw-post-data :force-binary t)
                                                                         (make-array 0 :element-type '(unsigned-byte 8))))))

(defun json-count (result key)
  "The integer KEY names in RESULT, the JSON line of test/http2-client.py, or NIL."
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings (format nil "\"~A\": (-?\\d+)" key) result))))
    (and match (parse-integer (aref match 0)))))

(test http2.every-octet-a-client-sends-is-read
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (let ((result (http2-client "big-headers" (ht:acceptor-port server) 100 7000)))
        (is (eql 100 (json-count result "answered")) "100 requests of 7,000-octet headers written at once: ~A"
            result))
      (let ((result (http2-client "uploads" (ht:acceptor-port server) 100 (* 1024 1024))))
        (is (eql 100 (json-count result "right")) "100 POST streams of 1 MiB, each body's digest: ~A" result)
        (is (search "\"closed_without_goaway\": false" result) "~A" result)))))

(test http2.every-octet-of-many-large-replies-arrives
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (let ((result (http2-client "downloads" (ht:acceptor-port server) 60 1024 2)))
        (is (eql 120 (json-count result "complete")) "60 streams of 1 MiB read at full speed, twice: ~A" result)
        (is (eql 0 (json-count result "closed_without_goaway")) "~A" result)))))

(test http2.one-client-takes-no-more-than-its-share-of-the-pool
  ;; 100 streams of a 3 s handler on one connection: a quarter of the
  ;; pool's 100 workers run them, the others wait their turn without a
  ;; worker; another connection is answered meanwhile.
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (let ((client (in-thread (lambda () (h2load (url server "/test/sleep?ms=3000") "-n" "100" "-c" "1" "-m" "100")))))
        (is (wait-until (lambda () (eql 25 (stats server :in-request-threads))) :timeout 20)
            "25 handlers of the connection run: ~D" (stats server :in-request-threads))
        (is (eql 200 (curl-reply (url server "/test/yo") :h2c)) "another HTTP/2 connection answered meanwhile")
        (is (eql 200 (http-get server "/test/yo")) "an HTTP/1.1 one too")
        (is (<= (stats server :in-request-threads) 25) "never more than its share: ~D"
            (stats server :in-request-threads))
        (destructuring-bind (succeeded failed seconds) (funcall client)
          (is (eql 100 succeeded) "every stream answered in its turn: ~A ~A ~A" succeeded failed seconds))))))

(test http2.what-costs-without-end-ends-with-enhance-your-calm
  (with-thread-leak-check ()
    (with-server (server (http2-server))
      (loop for (what . arguments) in '(("hpack-bomb" 5000) ("empty-frames" 10000000) ("priority-flood" 10000000))
            do (multiple-value-bind (result longest all-ok) (answered-meanwhile server
                                                                                (lambda () (apply #'http2-client what (ht:acceptor-port server) arguments)))
                 (declare (ignore longest))
                 (is (search "\"goaway\": 11" result) "~A: GOAWAY ENHANCE_YOUR_CALM: ~A" what result)
                 (is (search "\"closed\": true" result) "~A: and the connection closed: ~A" what result)
                 (is-true all-ok "~A: /test/yo answered 200 throughout" what)))
      (is (eql 3 (cdr (assoc "flood" (stats server :http2-goaways-by-cause) :test #'string=)))
          "each counted a flood: ~S" (stats server :http2-goaways-by-cause)))))

;;; Conformance: h2spec, built from ../shared/vendor/h2spec with Debian's Go
;;; (its copy has no main package: test/h2spec-driver.go is ours).

(defun h2spec-program ()
  "The h2spec driver, built once into a folder of the system's temporary
ones; NIL, and why, when it cannot be built."
  (let* ((source (merge-pathnames "../shared/vendor/h2spec/" (asdf:system-source-directory "hunchentoot-recycling-taskmaster")))
         (gopath (merge-pathnames "hrt-h2spec/" (uiop:temporary-directory)))
         (program (merge-pathnames "h2spec-driver" gopath)))
    (cond ((probe-file program) (namestring program))
          ((not (probe-file (merge-pathnames "h2spec.go" source)))
           (values nil "../shared/vendor/h2spec is missing"))
          (t (let ((package (merge-pathnames "src/github.com/summerwind/h2spec/" gopath))
                   (driver (merge-pathnames "src/h2spec-driver/" gopath)))
               (uiop:delete-directory-tree gopath :validate t :if-does-not-exist :ignore)
               (ensure-directories-exist package)
               (ensure-directories-exist driver)
               (uiop:run-program (list "cp" "-r" (format nil "~A." (namestring source)) (namestring package)))
               (uiop:run-program (list "rm" "-f" (namestring (merge-pathnames "go.mod" package))
                                       (namestring (merge-pathnames "go.sum" package))))
               (uiop:copy-file (asdf:system-relative-pathname "hunchentoot-recycling-taskmaster" "test/h2spec-driver.go")
                               (merge-pathnames "main.go" driver))
               (multiple-value-bind (output error-output status)
                   (uiop:run-program (list "env" "GO111MODULE=off"
                                           (format nil "GOPATH=~A:/usr/share/gocode" (string-right-trim "/" (namestring gopath)))
                                           (format nil "GOCACHE=~Acache" (namestring gopath))
                                           "go" "build" "-o" (namestring program) ".")
                                     :directory (namestring driver) :output :string :error-output :string
                                     :ignore-error-status t)
                 (declare (ignore output))
                 (if (eql 0 status)
                     (namestring program)
                     (values nil error-output))))))))

(defun h2spec-summary (port &rest arguments)
  "h2spec's closing line for the server on PORT: \"146 tests, ... passed\"."
  (multiple-value-bind (program why) (h2spec-program)
    (if program
        (let ((output (uiop:run-program (append (list "timeout" "120" program "-p" (princ-to-string port)) arguments)
                                        :output :string :ignore-error-status t)))
          (or (cl-ppcre:scan-to-strings "\\d+ tests, \\d+ passed, \\d+ skipped, \\d+ failed" output)
              (subseq output (max 0 (- (length output) 2000)))))
        (format nil "h2spec not built: ~A" why))))

(test http2.h2spec-passes-every-case-on-h2c-and-h2
  (with-server (server (http2-server))
    (let ((summary (h2spec-summary (ht:acceptor-port server))))
      (is (equal "146 tests, 146 passed, 0 skipped, 0 failed" summary) "h2c: ~A" summary)))
  (with-server (server (http2-ssl-server))
    (let ((summary (h2spec-summary (ht:acceptor-port server) "-t")))
      (is (equal "146 tests, 146 passed, 0 skipped, 0 failed" summary) "h2 over TLS: ~A" summary))))

(test http2.a-connection-refused-before-any-worker-is-refused-in-http/2
  ;; Every worker busy past the queue timeout: the h2c connection's stream
  ;; is answered 503 with Retry-After in HTTP/2's frames, then GOAWAY.
  (with-thread-leak-check ()
    (with-server (server (http2-server :queue-timeout 1
                                       :taskmaster (make-instance 'recycling-taskmaster :max-thread-count 2
                                                                                        :standby-thread-count 1)))
      (let ((busy (loop repeat 2 collect (in-thread (lambda () (http-get server "/test/sleep?ms=3000"))))))
        (is (wait-until (lambda () (eql 2 (stats server :in-request-threads)))))
        (let ((result (http2-client "statuses" (ht:acceptor-port server) "/test/yo")))
          (is (search "\"statuses\": [\"503\"]" result) "the stream answered 503 in HTTP/2: ~A" result)
          (is (search "\"retry_after\": [\"1\"]" result) "with Retry-After: ~A" result)
          (is (search "\"goaway\": 0" result) "then GOAWAY NO_ERROR: ~A" result))
        (dolist (join busy)
          (is (eql 200 (first (funcall join))))))
      (is (eql 1 (cdr (assoc "refused" (stats server :http2-goaways-by-cause) :test #'string=)))
          "counted: ~S" (stats server :http2-goaways-by-cause)))))

(test http2.refused-streams-cost-a-line-at-most
  ;; 10,000 streams the engine refuses: half whose handler defers its reply
  ;; once its headers are sent (REPLY-NOT-DEFERRABLE, one line), half with
  ;; a header list past the limit (431, none).
  (with-scratch-folder (directory)
    (let ((log (concatenate 'string directory "messages.log")))
      (with-server (server (http2-server :message-log-destination log))
        (h2load (url server "/test/http2/defer-after-headers") "-n" "5000" "-c" "4" "-m" "10")
        (h2load (url server "/test/yo") "-n" "5000" "-c" "4" "-m" "10"
                "-H" (format nil "x-big: ~A" (make-string 20000 :initial-element #\a)))
        (let ((octets (with-open-file (in log :if-does-not-exist nil) (if in (file-length in) 0))))
          (is (<= octets (* 200 10000)) "the message log grew ~D octets for 10,000 streams" octets)
          (is (= 5000 (log-lines-matching log "cannot be deferred")) "each deferral refused is logged, in one line")
          (is (zerop (log-lines-matching log "Backtrace")) "without a backtrace"))))))
