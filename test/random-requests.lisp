;;;; Random well-formed requests, each written as it is to Hunchentoot's
;;;; EASY-ACCEPTOR and to ours, over HTTP and over TLS, one to a connection
;;;; or several pipelined: the replies must be the same octets but for what
;;;; NORMALIZED-REPLY blanks, and the handler of /test/fields must see the
;;;; same request.  The requests are drawn from a fixed seed, so that a
;;;; failure names a request that can be sent again.  They avoid what ours
;;;; answers differently on purpose (docs/how-it-works.md): a missing or
;;;; invalid Host, transfer codings in HTTP/1.0, Range headers, targets in
;;;; absolute form, Expect in HTTP/1.0.

(in-package #:hunchentoot-recycling-taskmaster-test)

(in-suite replies)

(defparameter *random-request-count* 300
  "The requests, or pipelines of requests, CHECK-RANDOM-REQUESTS sends each server.")

(defun random-element (random-state &rest choices)
  (nth (random (length choices) random-state) choices))

(defun random-query (random-state)
  (format nil "~{~A~^&~}"
          (loop repeat (random 4 random-state)
                collect (format nil "~A=~A"
                                (random-element random-state "x" "a" "name" "x%20y" "x")
                                (random-element random-state "1" "" "two+words" "%C3%BC" "%FC" "a%26b" "%2B")))))

(defun random-body (random-state http-1.1-p)
  "Headers (an alist) and the text of a random request body, or NIL and NIL."
  (let* ((kind (random-element random-state :form :form :text :multipart :none))
         (text (ecase kind
                 (:form (random-element random-state "x=1&y=2" "x=%C3%BC" "x=%FC&x=2" "=x&y" "name=two+words"))
                 (:text (format nil "hello, w~Crld" (code-char 246)))
                 ;; Fields only: an uploaded file's temporary pathname counts
                 ;; up in the one image both servers run in.
                 (:multipart (crlf-lines "--XyZ" "Content-Disposition: form-data; name=\"x\"" "" "field"
                                         "--XyZ" "Content-Disposition: form-data; name=\"y\"" "" "other"
                                         "--XyZ--"))
                 (:none nil)))
         (octet-count (and text (length (flex:string-to-octets text :external-format :utf-8))))
         (chunked-p (and text http-1.1-p (zerop (random 4 random-state)))))
    (values (and text
                 (list (cons "Content-Type"
                             (ecase kind
                               (:form (random-element random-state "application/x-www-form-urlencoded"
                                                      "application/x-www-form-urlencoded; charset=utf-8"
                                                      "application/x-www-form-urlencoded; charset=iso-8859-1"))
                               (:text (random-element random-state "text/plain" "text/plain; charset=utf-8"))
                               (:multipart "multipart/form-data; boundary=XyZ")))
                       (if chunked-p
                           (cons "Transfer-Encoding" "chunked")
                           (cons "Content-Length" (princ-to-string octet-count)))))
            (cond ((not chunked-p) text)
                  ;; One chunk and the last one.
                  (t (format nil "~X~A~A~A" octet-count (crlf-lines "") text (crlf-lines "" "0" "")))))))

(defun random-request (random-state &key (connection "close"))
  "The text of a random well-formed request asking for the CONNECTION it names."
  (let* ((http-1.1-p (plusp (random 4 random-state)))
         (method (random-element random-state "GET" "GET" "GET" "HEAD" "POST" "POST" "PUT" "DELETE"
                                 "OPTIONS" "PATCH"))
         (path (random-element random-state "/test/fields" "/test/fields" "/test/fields/a%20b"
                               "/test/params" "/test/body" "/test/get-cookie" "/test/utf-8" "/test/error"
                               "/test/chunked-reply" "/test/nowhere" "/test/set-cookie"))
         (query (random-query random-state))
         (host (and (or http-1.1-p (zerop (random 2 random-state)))
                    (random-element random-state "localhost" "localhost:8080" "example.org")))
         (headers (remove nil (list (and host (cons "Host" host))
                                    (and (zerop (random 3 random-state))
                                         (cons "Cookie" (random-element random-state "a=lemon" "a=b; c=d"
                                                                        "flavour=x; flavour=y")))
                                    (and (zerop (random 3 random-state))
                                         (cons "User-Agent" "random-requests/1.0"))
                                    (and (zerop (random 4 random-state))
                                         (cons "X-Note" (random-element random-state "two  spaces" ""
                                                                        (format nil "tab~Cin" #\Tab)
                                                                        (string (code-char 252)))))
                                    (and http-1.1-p (zerop (random 8 random-state))
                                         (cons "Expect" "100-continue"))))))
    (multiple-value-bind (body-headers body)
        (if (member method '("POST" "PUT" "PATCH") :test #'string=)
            (random-body random-state http-1.1-p)
            (values nil nil))
      (concatenate 'string
                   (apply #'crlf-lines (format nil "~A ~A~:[~;?~:*~A~] HTTP/1.~:[0~;1~]"
                                               method path (and (plusp (length query)) query) http-1.1-p)
                          (append (loop for (name . value) in (append headers body-headers
                                                                      (list (cons "Connection" connection)))
                                        collect (format nil "~A: ~A" name value))
                                  (list "")))
                   body))))

(defun random-requests (random-state pipelined-p)
  "The text of one random request, or when PIPELINED-P of two to four
written together, all but the last kept alive."
  (format nil "~{~A~}"
          (loop for count downfrom (if pipelined-p (+ 2 (random 3 random-state)) 1) above 0
                collect (random-request random-state :connection (if (= count 1) "close" "keep-alive")))))

(defun read-to-end (stream)
  "The octets from STREAM until the server closes the connection, as a
Latin-1 string."
  (let ((text (make-array 0 :element-type 'character :adjustable t :fill-pointer t)))
    (loop for octet = (handler-case (read-byte stream nil)
                        ;; A reset, or TLS cut without its closing alert.
                        (error () nil))
          while octet
          do (vector-push-extend (code-char octet) text))
    (coerce text 'simple-string)))

(defun reply-until-closed (server requests)
  "What SERVER answers to REQUESTS (text that ends with a request closing
its connection), written on a connection of its own, over TLS when SERVER
is an SSL acceptor, normalized as NORMALIZED-REPLY does; :TIMEOUT when the
connection is still open 5 s later."
  (with-connection (socket server)
    (handler-case
        (bt:with-timeout (5)
          (let ((stream (if (ht:acceptor-ssl-p server)
                            (cl+ssl:make-ssl-client-stream (usocket:socket-stream socket) :verify nil)
                            (usocket:socket-stream socket))))
            (write-sequence (flex:string-to-octets requests :external-format :utf-8) stream)
            (finish-output stream)
            (normalized-reply (read-to-end stream))))
      (bt:timeout () :timeout))))

(defun check-random-requests (their-class our-class &key pipelined-p initargs)
  "Send *RANDOM-REQUEST-COUNT* random requests, or pipelines of them when
PIPELINED-P, to an acceptor of THEIR-CLASS and one of OUR-CLASS, both made
of INITARGS; each must be answered alike."
  (let ((random-state (sb-ext:seed-random-state 20261126))
        (timeouts 0))
    (with-thread-leak-check ()
      (with-server (theirs (apply #'make-server their-class initargs))
        (with-server (ours (apply #'make-server our-class initargs))
          (loop repeat *random-request-count*
                for number from 1
                ;; A server that no longer answers would cost every case
                ;; its timeout: three are enough to fail.
                while (< timeouts 3)
                do (let* ((requests (random-requests random-state pipelined-p))
                          (their-reply (reply-until-closed theirs requests))
                          (our-reply (reply-until-closed ours requests)))
                     (when (member :timeout (list their-reply our-reply))
                       (incf timeouts))
                     (is (stringp their-reply) "case ~D, ~S: ~A answered ~S" number requests their-class their-reply)
                     (is (equal their-reply our-reply) "case ~D, ~S:~%~A answers~%~A~%~A answers~%~A"
                         number requests our-class our-reply their-class their-reply))))))))

(test replies.random-requests-same-as-hunchentoot
  (check-random-requests 'ht:easy-acceptor 'parallel-easy-acceptor))

(test replies.random-requests-over-tls-same-as-hunchentoot
  (multiple-value-bind (certificate key) (certificate-files)
    (check-random-requests 'ht:easy-ssl-acceptor 'parallel-easy-ssl-acceptor
                           :initargs (list :ssl-certificate-file certificate :ssl-privatekey-file key))))

(test replies.random-pipelines-same-as-hunchentoot
  ;; Two to four requests written at once, all but the last kept alive: the
  ;; engine reads each next head from what arrived with the one before.
  (check-random-requests 'ht:easy-acceptor 'parallel-easy-acceptor :pipelined-p t))
