;;;; Request bodies and the strings that come with them: chunked bodies
;;;; decoded in bounded memory, malformed ones answered 400, and no keyword
;;;; interned from a trailer name or a Content-Type charset.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite bodies :in all :description "Request bodies, trailers and charsets.")
(in-suite bodies)

(ht:define-easy-handler (test-trailers :uri "/test/trailers") ()
  (setf (ht:content-type*) "text/plain")
  (let ((body (ht:raw-post-data :force-binary t)))
    (format nil "~A|~{~A=~A~^,~}" (map 'string #'code-char body)
            (loop for (name . value) in (chunga:chunked-input-stream-trailers
                                         (ht::content-stream ht:*request*))
                  collect name collect value))))

(ht:define-easy-handler (test-content-type :uri "/test/content-type") ()
  (setf (ht:content-type*) "text/plain")
  (or (ht:header-in* :content-type) "none"))

(defun chunked-post (path body &rest headers)
  (concatenate 'string
               (apply #'crlf-lines (format nil "POST ~A HTTP/1.1" path) "Host: localhost"
                      "Transfer-Encoding: chunked" (append headers '("")))
               body))

(defun keyword-count ()
  (let ((count 0))
    (do-symbols (symbol "KEYWORD" count)
      (declare (ignore symbol))
      (incf count))))

(defun unique-prefix ()
  (format nil "Z~36R" (random (expt 2 64) (make-random-state t))))

(test bodies.chunked-body-and-known-trailers-are-read
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (concatenate 'string
                                     (chunked-post "/test/trailers"
                                                   (crlf-lines "3;name=value" "abc" "2" "de" "0"
                                                               "Content-Type: x" "X-Made-Up-Trailer: y" ""))
                                     (get-request "/test/yo")))
      (multiple-value-bind (status body) (read-response socket)
        (is (eql 200 status))
        (is (equal "abcde|CONTENT-TYPE=x" body)
            "chunk extensions ignored, a trailer whose name is a keyword kept, a made-up one dropped: ~S" body))
      (is (eql 200 (read-response socket)) "the pipelined request after the body is answered"))))

(test bodies.claimed-chunk-size-allocates-nothing
  ;; No body limit: the default one would refuse the claim at once.
  (with-readiness-server (server :max-body-bytes nil)
    (with-connection (socket server)
      ;; 2^59 octets claimed: Chunga would allocate a buffer that large.
      (send-text socket (chunked-post "/test/body" (crlf-lines "7FFFFFFFFFFFFFF" "abc")))
      (is (null (read-response socket :timeout 1)) "no reply before the body's end")
      (is-false (closed-by-server-p socket) "the rest of the chunk is waited for, not refused for want of memory"))
    (is (eql 200 (http-get server "/test/yo")) "and the server goes on serving")))

(defun decode-chunked (text &key max-body-bytes)
  "What the engine's decoder reads from the chunked body TEXT followed by
NEXT: the body as a string, its trailers, and what it left unread."
  (let* ((in (flex:make-in-memory-input-stream
              (flex:string-to-octets (concatenate 'string text "NEXT") :external-format :latin-1)))
         (stream (hunchentoot-recycling-taskmaster::make-chunked-body-stream
                  (make-two-way-stream in (make-broadcast-stream)) max-body-bytes))
         (body (map 'string #'code-char (loop for octet = (read-byte stream nil) while octet collect octet))))
    (values body
            (chunga:chunked-input-stream-trailers stream)
            (map 'string #'code-char (loop for octet = (read-byte in nil) while octet collect octet)))))

(defparameter *malformed-chunked-bodies*
  `(("no chunk size" ,(crlf-lines "" "abc" "0" ""))
    ("a chunk size of 16 digits" ,(crlf-lines "1000000000000000" "abc"))
    ("a size followed by garbage" ,(crlf-lines "3x" "abc" "0" ""))
    ("a bare LF after the size" ,(format nil "3~Cabc~C~C0~C~C~C~C" #\Linefeed #\Return #\Linefeed
                                         #\Return #\Linefeed #\Return #\Linefeed))
    ("chunk data longer than its size" ,(crlf-lines "3" "abcd" "0" ""))
    ("a chunk-size line of 5,000 octets" ,(crlf-lines (format nil "3;~A" (make-string 5000 :initial-element #\x))
                                                     "abc" "0" ""))
    ("a trailer section of 20,000 octets"
     ,(crlf-lines "3" "abc" "0" (format nil "X-T: ~A" (make-string 20000 :initial-element #\t)) "")))
  "Chunked bodies that break RFC 9112's coding or a limit, each with what is wrong.")

(test bodies.decoder-reads-to-the-body-end-and-keeps-known-trailers
  (multiple-value-bind (body trailers rest)
      (decode-chunked (crlf-lines "3;ext=1" "abc" "A" "0123456789" "1" "x" "0" "Content-Md5: m"
                                  "X-Not-A-Keyword-Anywhere: y" ""))
    (is (equal "abc0123456789x" body))
    (is (equal '((:content-md5 . "m")) trailers) "a trailer field name is never interned: ~S" trailers)
    (is (equal "NEXT" rest) "the decoder stops at the body's end")))

(test bodies.decoder-refuses-what-the-engine-refuses
  (loop for (description body) in *malformed-chunked-bodies*
        do (is (typep (handler-case (progn (decode-chunked body) nil)
                        (error (condition) condition))
                      'chunked-body-malformed)
               "~A: CHUNKED-BODY-MALFORMED" description))
  (is (typep (handler-case (progn (decode-chunked (crlf-lines "3" "abc" "0" "") :max-body-bytes 2) nil)
               (error (condition) condition))
             'request-body-too-large)
      "chunks beyond the limit: REQUEST-BODY-TOO-LARGE"))

(test bodies.malformed-chunked-bodies-are-400-and-closed
  (with-readiness-server (server)
    (loop for (description body) in *malformed-chunked-bodies*
          for count from 1
          do (multiple-value-bind (status closed-p)
                 (refused-with server (concatenate 'string (chunked-post "/test/body" body) (get-request "/test/yo")))
               (is (eql 400 status) "~A: expected 400, got ~S" description status)
               (is-true closed-p "~A: the connection is closed, the request after it unanswered" description)
               (is (= count (stats server :bad-request-replies)) "~A counted" description)))
    (is (eql 200 (http-get server "/test/yo")))))

(test bodies.trailer-names-are-not-interned
  (with-readiness-server (server)
    (let ((prefix (unique-prefix))
          (keywords-before (keyword-count)))
      (flet ((name (request line) (format nil "X-~A-~D-~D" prefix request line)))
        ;; 1,000 requests of 100 made-up trailer names each, 100 per connection.
        (is (= 1000 (loop for connection below 10
                          sum (with-connection (socket server)
                                (loop for index below 100
                                      for request = (+ (* connection 100) index)
                                      do (send-text socket
                                                    (chunked-post "/test/body"
                                                                  (apply #'crlf-lines "1" "a" "0"
                                                                         (append (loop for line below 100
                                                                                       collect (format nil "~A: v" (name request line)))
                                                                                 '("")))))
                                      while (eql 200 (read-response socket))
                                      count t))))
            "every request answered 200")
        (is (notany (lambda (request) (find-symbol (string-upcase (name request 99)) "KEYWORD"))
                    (loop for request below 1000 collect request))
            "no trailer name is a keyword")
        (is (< (- (keyword-count) keywords-before) 100)
            "100,000 trailer names added ~D keywords" (- (keyword-count) keywords-before))))))

(defclass warnings-muffled-acceptor (parallel-easy-acceptor) ()
  (:documentation "Muffles the warnings its requests signal: each of the
20,000 invalid charsets below is warned of, as Hunchentoot warns, and the
suite's output would print each."))

(defmethod ht:process-connection :around ((acceptor warnings-muffled-acceptor) socket)
  (declare (ignore socket))
  (handler-bind ((warning #'muffle-warning))
    (call-next-method)))

(test bodies.charsets-are-not-interned
  (with-thread-leak-check ()
    (with-server (server (make-server 'warnings-muffled-acceptor))
      (let ((prefix (unique-prefix))
            (keywords-before (keyword-count)))
        (flet ((charset (index) (format nil "x-~A-~D" prefix index)))
          ;; 20,000 requests on 20 connections, 1,000 pipelined on each.
          (is (= 20000 (loop for connection below 20
                             sum (with-connection (socket server)
                                   (flet ((content-type (index)
                                            (format nil "text/plain; charset=~A" (charset (+ (* connection 1000) index)))))
                                     (send-text socket (with-output-to-string (out)
                                                         (dotimes (index 1000)
                                                           (write-string (get-request "/test/content-type"
                                                                                      (format nil "Content-Type: ~A"
                                                                                              (content-type index)))
                                                                         out))))
                                     (loop for index below 1000
                                           while (multiple-value-bind (status body) (read-response socket)
                                                   (and (eql 200 status) (equal (content-type index) body)))
                                           count t)))))
              "every request answered 200, its handler seeing the Content-Type the client sent")
          (is (notany (lambda (index) (find-symbol (string-upcase (charset index)) "KEYWORD"))
                      (loop for index below 20000 collect index))
              "no charset is a keyword")
          (is (< (- (keyword-count) keywords-before) 100)
              "20,000 charsets added ~D keywords" (- (keyword-count) keywords-before)))))))

(test bodies.known-charsets-still-decode-parameters
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (get-request "/test/params?name=%E9" "Content-Type: text/plain; charset=iso-8859-1"))
      (is (equal "name=é" (nth-value 1 (read-response socket)))
          "a charset Hunchentoot knows decodes the query string as before"))))

;;; The body limit.

(defun post-head (path length &rest headers)
  "A POST head to PATH declaring LENGTH octets of body, and no body."
  (apply #'crlf-lines (format nil "POST ~A HTTP/1.1" path) "Host: localhost"
         (format nil "Content-Length: ~D" length) (append headers '(""))))

(defun post-with-length (length &rest headers)
  "A POST head to /test/body declaring LENGTH octets of body, and no body."
  (apply #'post-head "/test/body" length headers))

(test bodies.over-the-limit-is-413-and-closed
  (with-readiness-server (server :max-body-bytes 1000)
    (multiple-value-bind (status closed-p) (refused-with server (post-with-length 1001))
      (is (eql 413 status) "a Content-Length over the limit: ~S" status)
      (is-true closed-p))
    (with-connection (socket server)
      (send-text socket (concatenate 'string (post-with-length 1000) (make-string 1000 :initial-element #\a)))
      (is (equal "1000 97000" (nth-value 1 (read-response socket))) "a body of the limit is taken"))
    (multiple-value-bind (status closed-p)
        (refused-with server (chunked-post "/test/body" (crlf-lines "1F4" (make-string 500 :initial-element #\a)
                                                                     "1F5" (make-string 501 :initial-element #\a)
                                                                     "0" "")))
      (is (eql 413 status) "chunks adding up to more than the limit: ~S" status)
      (is-true closed-p))
    (with-connection (socket server)
      (send-text socket (chunked-post "/test/body" (crlf-lines "3E8" (make-string 1000 :initial-element #\a) "0" "")))
      (is (equal "1000 97000" (nth-value 1 (read-response socket))) "chunks adding up to the limit are taken"))
    (is (= 2 (stats server :content-too-large-replies)))))

(test bodies.over-the-limit-gets-no-100-continue
  (with-readiness-server (server :max-body-bytes 1000)
    (with-connection (socket server)
      (send-text socket (post-with-length 5000 "Expect: 100-continue"))
      (multiple-value-bind (status body head) (read-response socket)
        (declare (ignore body))
        (is (eql 413 status) "the final status at once, no 100: ~S" head)))
    (with-connection (socket server)
      (send-text socket (post-with-length 3 "Expect: 100-continue"))
      (is (eql 100 (read-response socket)) "a body within the limit gets its 100 Continue")
      (send-text socket "abc")
      (is (equal "3 294" (nth-value 1 (read-response socket)))))))

(test bodies.a-gigabyte-declared-costs-nothing
  ;; At the default limit (64 MiB) a head declaring 1 GB is refused before
  ;; anything is allocated for it.
  (with-readiness-server (server)
    (let ((consed-before (sb-ext:get-bytes-consed)))
      (multiple-value-bind (status closed-p) (refused-with server (post-with-length (expt 10 9)))
        (is (eql 413 status))
        (is-true closed-p))
      (is (< (- (sb-ext:get-bytes-consed) consed-before) (* 10 1024 1024))
          "~D octets consed for one refused head" (- (sb-ext:get-bytes-consed) consed-before)))))

;;; A multipart body read to its length.

(defun unterminated-multipart-post (value-octets &key chunked-p)
  "A multipart/form-data POST to /test/params with a Content-Length (or,
when CHUNKED-P, chunked in one chunk): one part of VALUE-OCTETS octets, and
no closing boundary after it."
  (let ((body (concatenate 'string
                           (crlf-lines "--x" "Content-Disposition: form-data; name=\"a\"" "")
                           (make-string value-octets :initial-element #\b)))
        (content-type "Content-Type: multipart/form-data; boundary=x"))
    (if chunked-p
        (chunked-post "/test/params" (crlf-lines (format nil "~X" (length body)) body "0" "") content-type)
        (concatenate 'string (post-head "/test/params" (length body) content-type) body))))

(test bodies.multipart-body-without-its-closing-boundary-ends-with-the-body
  ;; Hunchentoot's multipart parser reads until the closing boundary, which
  ;; this body lacks: it read on past the Content-Length, taking the next
  ;; request's octets for the body's, then waited on the socket until the
  ;; client closed.  A body in the head's buffer, one that arrives after it,
  ;; and chunked ones.
  (with-readiness-server (server)
    (loop for (value-octets chunked-p) in '((10 nil) (200000 nil) (10 t) (200000 t))
          do (with-connection (socket server)
               (send-text socket (concatenate 'string (unterminated-multipart-post value-octets :chunked-p chunked-p)
                                              (get-request "/test/yo")))
               (is (eql 200 (read-response socket))
                   "the POST of ~D octets~:[~; chunked~] is answered" value-octets chunked-p)
               (multiple-value-bind (status body) (read-response socket)
                 (is (and (eql 200 status) (equal "Hey!" body))
                     "the GET after the POST of ~D octets~:[~; chunked~] is answered itself: ~S ~S"
                     value-octets chunked-p status body))))))

;;; Bodies the engine reads before dispatch.

(ht:define-easy-handler (test-body-stream :uri "/test/body-stream") ()
  (setf (ht:content-type*) "text/plain")
  (let ((stream (ht:raw-post-data :want-stream t))
        (count 0)
        (sum 0))
    (loop for octet = (read-byte stream nil)
          while octet
          do (incf count)
             (incf sum octet))
    (format nil "~D ~D" count sum)))

(defun octets-text (count character)
  (make-string count :initial-element character))

(defun send-body-head (server path length first-octets &rest headers)
  "A connection to SERVER on which a POST head to PATH declaring LENGTH
octets has been sent, with FIRST-OCTETS of its body."
  (let ((socket (connect server)))
    (send-text socket (concatenate 'string (apply #'post-head path length headers) first-octets))
    socket))

(defun body-files (directory)
  ;; Without :RESOLVE-SYMLINKS NIL, SBCL's DIRECTORY takes the truename of
  ;; each file it lists, and signals when the server removes one meanwhile.
  (directory (merge-pathnames "hrt-body-*" directory) :resolve-symlinks nil))

(defmacro with-temporary-body-directory ((var) &body body)
  "Run BODY with HUNCHENTOOT:*TMP-DIRECTORY*, which the workers read, set to
a new empty directory VAR; remove it afterwards."
  (let ((before (gensym "BEFORE")))
    `(let ((,var (ensure-directories-exist
                  (merge-pathnames (format nil "hrt-test-bodies-~A/" (unique-prefix))
                                   (uiop:temporary-directory))))
           (,before ht:*tmp-directory*))
       (setf ht:*tmp-directory* ,var)
       (unwind-protect (progn ,@body)
         (setf ht:*tmp-directory* ,before)
         (uiop:delete-directory-tree ,var :validate t :if-does-not-exist :ignore)))))

(defun check-arriving-bodies-hold-no-worker (server send-head send-rest &key request-after-body-p)
  "Six clients start a POST to SERVER (at most two workers) with SEND-HEAD,
which returns the connection it sent a head and the first 1,000 octets of
a 3,000-octet body of #\\a and #\\b on; while they wait, another client is
served; then SEND-REST sends each the rest, and each handler must read the
whole body (and, when REQUEST-AFTER-BODY-P, answer the request SEND-REST
sent after it)."
  (let ((sockets (loop repeat 6 collect (funcall send-head))))
    (unwind-protect
         (progn
           (is (wait-until (lambda () (= 6 (stats server :arriving-bodies))))
               "six bodies arrive, read by the engine: ~D" (stats server :arriving-bodies))
           (is (zerop (stats server :in-request-threads)) "none dispatched before its body is whole")
           (is (eql 200 (http-get server "/test/yo"))
               "another client is served while six send their bodies, with two workers at most")
           (is (<= (stats server :threads) 2))
           (mapc send-rest sockets)
           (dolist (socket sockets)
             (is (equal "3000 293000" (nth-value 1 (read-response socket)))
                 "each handler reads its whole body")
             (when request-after-body-p
               (is (eql 200 (read-response socket)) "the request after the body is answered")))
           ;; A body is forgotten once its reply has gone, which the client
           ;; may read first.
           (is (wait-until (lambda () (zerop (stats server :arriving-bodies))))
               "every body forgotten: ~D left" (stats server :arriving-bodies)))
      (mapc #'usocket:socket-close sockets))))

(test bodies.arriving-bodies-hold-no-worker
  (with-thread-leak-check ()
    (with-server (server (pooled-server :standby-thread-count 1 :max-thread-count 2))
      (check-arriving-bodies-hold-no-worker
       server
       (lambda () (send-body-head server "/test/body" 3000 (octets-text 1000 #\a)))
       (lambda (socket) (send-text socket (octets-text 2000 #\b)))))))

(test bodies.a-declared-gigabyte-that-never-comes-is-408-at-the-read-timeout
  ;; No body limit, so that the head is not refused at once.
  (uiop:with-temporary-file (:pathname access-log)
    (uiop:with-temporary-file (:pathname message-log)
      (with-readiness-server (server :max-body-bytes nil :read-timeout 1 :write-timeout 1
                                     :access-log-destination access-log :message-log-destination message-log)
        (with-connection (socket server)
          (let ((consed-before (sb-ext:get-bytes-consed))
                (sent (get-internal-real-time)))
            (send-text socket (post-with-length (expt 10 9)))
            (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
            (is (zerop (stats server :in-request-threads)) "no worker waits for the body")
            (multiple-value-bind (status body) (read-response socket)
              (let ((seconds (/ (- (get-internal-real-time) sent) internal-time-units-per-second)))
                (is (eql 408 status) "a stalled body is answered 408: ~S" status)
                (is (search "body did not arrive" body) "its page says why: ~S" body)
                (is (<= 0.9 seconds 5) "at the read timeout (1 s), not ~,1F s" seconds)))
            (is-true (closed-by-server-p socket))
            (is (< (- (sb-ext:get-bytes-consed) consed-before) (* 10 1024 1024))
                "~D octets consed for a gigabyte declared" (- (sb-ext:get-bytes-consed) consed-before))
            (is (= 1 (stats server :body-timeout-replies)))
            ;; The 408 goes out before the body is forgotten.
            (is (wait-until (lambda () (zerop (stats server :arriving-bodies)))))))
        (ht:stop server)
        (let ((logged (+ (with-open-file (in access-log) (file-length in))
                         (with-open-file (in message-log) (file-length in)))))
          (is (< 0 logged 500) "a log line of a few hundred octets, not ~D" logged))))))

(test bodies.a-body-beyond-the-buffer-goes-to-a-file-removed-afterwards
  (with-temporary-body-directory (directory)
    (with-readiness-server (server :body-buffer-bytes 1000)
      (flet ((arrive-in-three-parts (path length first second &rest headers)
               ;; The third part is the caller's to send.
               (is (wait-until (lambda () (and (zerop (stats server :arriving-bodies))
                                               (null (body-files directory)))))
                   "the previous request's body file is removed")
               (let ((socket (apply #'send-body-head server path length first headers)))
                 (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
                 (is (null (body-files directory)) "500 octets stay in memory: ~S" (body-files directory))
                 (send-text socket second)
                 (is (wait-until (lambda () (= 1 (length (body-files directory)))))
                     "2,500 octets go on in a file")
                 socket)))
        (let ((socket (arrive-in-three-parts "/test/body" 5000 (octets-text 500 #\a) (octets-text 2000 #\b))))
          (unwind-protect
               (progn
                 (send-text socket (octets-text 2500 #\c))
                 (is (equal "5000 492000" (nth-value 1 (read-response socket))) "RAW-POST-DATA reads it whole")
                 (is (wait-until (lambda () (null (body-files directory)))) "the file is removed after the request")
                 (send-text socket (get-request "/test/yo"))
                 (is (eql 200 (read-response socket)) "and the connection is kept alive"))
            (usocket:socket-close socket)))
        (let ((socket (arrive-in-three-parts "/test/body-stream" 5000 (octets-text 500 #\a) (octets-text 2000 #\b))))
          (unwind-protect
               (progn
                 (send-text socket (octets-text 2500 #\c))
                 (is (equal "5000 492000" (nth-value 1 (read-response socket)))
                     "so does the stream of (RAW-POST-DATA :WANT-STREAM T)"))
            (usocket:socket-close socket)))
        (let* ((preamble (crlf-lines "--XyZ" "Content-Disposition: form-data; name=\"note\"" "" "hello"
                                     "--XyZ"
                                     "Content-Disposition: form-data; name=\"file\"; filename=\"a.bin\""
                                     "Content-Type: application/octet-stream" ""))
               (ending (crlf-lines "" "--XyZ--"))
               (socket (arrive-in-three-parts "/test/upload" (+ 3000 (length ending))
                                              (concatenate 'string preamble
                                                           (octets-text (- 500 (length preamble)) #\a))
                                              (octets-text 2000 #\b)
                                              "Content-Type: multipart/form-data; boundary=XyZ")))
          (unwind-protect
               (progn
                 (send-text socket (concatenate 'string (octets-text 500 #\c) ending))
                 (is (equal (format nil "a.bin ~D ~D" (- 3000 (length preamble))
                                    (+ (* 97 (- 500 (length preamble))) (* 98 2000) (* 99 500)))
                            (nth-value 1 (read-response socket)))
                     "a multipart upload is parsed from the file"))
            (usocket:socket-close socket)))
        (let ((socket (arrive-in-three-parts "/test/body" 5000 (octets-text 500 #\a) (octets-text 2000 #\b))))
          (usocket:socket-close socket)
          (is (wait-until (lambda () (null (body-files directory))))
              "a client that leaves mid-body leaves no file behind")
          (is (wait-until (lambda () (zerop (stats server :arriving-bodies))))))))))

(test bodies.stop-closes-connections-whose-body-is-arriving
  (with-temporary-body-directory (directory)
    (with-thread-leak-check ()
      (let ((server (readiness-server :body-buffer-bytes 1000)))
        (ht:start server)
        (let ((small (send-body-head server "/test/body" 5000 (octets-text 500 #\a)))
              (large (send-body-head server "/test/body" 5000 (octets-text 500 #\a))))
          (unwind-protect
               (progn
                 (is (wait-until (lambda () (= 2 (stats server :arriving-bodies)))))
                 (send-text large (octets-text 2500 #\a))
                 (is (wait-until (lambda () (and (= 2 (stats server :arriving-bodies))
                                                 (= 1 (length (body-files directory)))))))
                 (ht:stop server)
                 (is-true (closed-by-server-p small) "STOP closes a connection whose body is arriving")
                 (is-true (closed-by-server-p large))
                 (is (null (body-files directory)) "and removes the body's file"))
            (usocket:socket-close small)
            (usocket:socket-close large)))))))

(test bodies.a-body-that-cannot-be-stored-is-500
  (with-temporary-body-directory (directory)
    ;; A directory under a regular file can never be made.
    (let ((blocker (merge-pathnames "not-a-directory" directory)))
      (with-open-file (out blocker :direction :output) (write-line "x" out))
      (setf ht:*tmp-directory* (merge-pathnames "bodies/" (uiop:ensure-directory-pathname blocker)))
      (with-readiness-server (server :body-buffer-bytes 1000)
        (with-connection (socket server)
          (send-text socket (concatenate 'string (post-with-length 5000) (octets-text 500 #\a)))
          (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
          (send-text socket (octets-text 2000 #\a))
          (is (eql 500 (read-response socket)) "the client is told, not left waiting")
          (is-true (closed-by-server-p socket)))
        (is (= 1 (stats server :body-not-stored-replies)))
        ;; Forgotten when the connection is closed, after the reply and FIN.
        (is (wait-until (lambda () (zerop (stats server :arriving-bodies)))))
        (is (eql 200 (http-get server "/test/yo")) "and the server goes on serving")))))

;;; Chunked bodies read by the engine.

(defun chunk (text)
  "TEXT as one chunk of a chunked body."
  (crlf-lines (format nil "~X" (length text)) text))

(defun send-chunked-head (server path first-octets &rest headers)
  "A connection to SERVER on which a chunked POST head to PATH has been sent,
with FIRST-OCTETS of its body."
  (let ((socket (connect server)))
    (send-text socket (concatenate 'string (apply #'chunked-post path "" headers) first-octets))
    socket))

(defmacro with-chunked-post ((var server path first-octets) &body body)
  "Run BODY with VAR a connection to SERVER on which a chunked POST head to
PATH and FIRST-OCTETS of its body have been sent; close it afterwards."
  `(let ((,var (send-chunked-head ,server ,path ,first-octets)))
     (unwind-protect (progn ,@body)
       (ignore-errors (usocket:socket-close ,var)))))

(test bodies.chunked-bodies-arriving-hold-no-worker
  (with-thread-leak-check ()
    (with-server (server (pooled-server :standby-thread-count 1 :max-thread-count 2))
      (check-arriving-bodies-hold-no-worker
       server
       (lambda () (send-chunked-head server "/test/body" (chunk (octets-text 1000 #\a))))
       (lambda (socket)
         ;; The next request comes in the same write as the body's end.
         (send-text socket (concatenate 'string (chunk (octets-text 2000 #\b)) (crlf-lines "0" "")
                                        (get-request "/test/yo"))))
       :request-after-body-p t))))

(test bodies.chunked-body-taken-octet-by-octet
  ;; Every state of the framing is left and resumed between two reads.
  (with-readiness-server (server)
    (with-connection (socket server)
      (let ((body (crlf-lines "3;name=value" "abc" "2" "de" "0" "Content-Type: x" "X-Made-Up-Trailer: y" "")))
        (send-text socket (chunked-post "/test/trailers" ""))
        (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
        (loop for character across body
              do (send-text socket (string character))
                 (sleep 0.002))
        (multiple-value-bind (status reply) (read-response socket)
          (is (eql 200 status))
          (is (equal "abcde|CONTENT-TYPE=x" reply) "the same body and trailers as in one piece: ~S" reply))
        (send-text socket (get-request "/test/yo"))
        (is (eql 200 (read-response socket)) "and the connection is kept alive")))))

(test bodies.chunked-bodies-arriving-refused
  (with-readiness-server (server :max-body-bytes 1000 :body-buffer-bytes 1000)
    (loop for (description status rest) in
          `(("a chunk size of 16 digits" 400 ,(crlf-lines "1000000000000000" "abc"))
            ("a size followed by garbage" 400 ,(crlf-lines "3x" "abc" "0" ""))
            ("chunk data longer than its size" 400 ,(crlf-lines "3" "abcd" "0" ""))
            ("a bare LF after the size" 400 ,(format nil "3~Cabc" #\Linefeed))
            ("a chunk-size line of 5,000 octets" 400 ,(crlf-lines (format nil "3;~A" (octets-text 5000 #\x))))
            ("a trailer of 1 MB" 400 ,(crlf-lines "0" (format nil "X-T: ~A" (octets-text 1000000 #\t)) ""))
            ("chunks adding up to more than the limit" 413 ,(chunk (octets-text 600 #\a))))
          do (with-chunked-post (socket server "/test/body" (chunk (octets-text 500 #\a)))
               (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
               (ignore-errors (send-text socket rest))
               (is (eql status (read-response socket)) "~A: expected ~D" description status)
               (is-true (closed-by-server-p socket) "~A: the connection is closed" description)
               (is (wait-until (lambda () (zerop (stats server :arriving-bodies)))))))
    (is (= 6 (stats server :bad-request-replies)))
    (is (= 1 (stats server :content-too-large-replies)))
    (is (eql 200 (http-get server "/test/yo")))))

(test bodies.chunked-body-beyond-the-buffer-goes-to-a-file-removed-afterwards
  (with-temporary-body-directory (directory)
    (with-readiness-server (server :body-buffer-bytes 1000)
      (with-chunked-post (socket server "/test/body" (chunk (octets-text 500 #\a)))
        (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
        (send-text socket (chunk (octets-text 2000 #\b)))
        (is (wait-until (lambda () (= 1 (length (body-files directory))))) "the body goes on in a file")
        (send-text socket (concatenate 'string (chunk (octets-text 2500 #\c)) (crlf-lines "0" "")))
        (is (equal "5000 492000" (nth-value 1 (read-response socket))) "decoded from the file")
        (is (wait-until (lambda () (null (body-files directory)))) "the file is removed after the request")))))

(test bodies.chunked-body-that-stalls-is-408-at-the-read-timeout
  (with-readiness-server (server :read-timeout 1 :write-timeout 1)
    (with-chunked-post (socket server "/test/body" (chunk "abc"))
      (is (wait-until (lambda () (= 1 (stats server :arriving-bodies)))))
      (is (eql 408 (read-response socket)))
      (is-true (closed-by-server-p socket))
      (is (= 1 (stats server :body-timeout-replies))))))

(test bodies.chunked-body-gets-its-100-continue-when-reading-starts
  (with-readiness-server (server)
    (with-connection (socket server)
      (send-text socket (chunked-post "/test/body" "" "Expect: 100-continue"))
      (is (eql 100 (read-response socket)) "a chunked body within the limit gets its 100 Continue")
      (send-text socket (concatenate 'string (chunk "abc") (crlf-lines "0" "")))
      (is (equal "3 294" (nth-value 1 (read-response socket)))))))
